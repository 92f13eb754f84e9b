//! Lines on stdout that never panic. `println!` panics when stdout is a closed pipe
//! (`transponder train ... | head -2`) or a full disk (`> /dev/full`), which would cost a
//! training run its work. Two kinds of line:
//!
//! - progress ([`say`], the `say!` macro): the lines of long commands (`train`,
//!   `train-image`, `compare`, `analyze`), whose results are files. After the first failed
//!   write, one note goes to stderr and every later line is dropped; the work goes on.
//! - results ([`emit`], the `emit!` macro): what a short command exists to print (`sample`'s
//!   text, `eval`'s loss, the files `prepare` and `export` wrote). A failed write is a
//!   [`StdoutError`]; `main` ends quietly on a closed pipe and reports any other failure.

use std::fmt;
use std::io::{self, Write};
use std::sync::atomic::{AtomicBool, Ordering};

/// Set once a progress line could not be written: later ones are not attempted.
static STDOUT_LOST: AtomicBool = AtomicBool::new(false);
/// Set on the ranks other than 0 of a data-parallel run: they print errors only.
static QUIET: AtomicBool = AtomicBool::new(false);

/// Drops every later progress line and warning of this process (a data-parallel rank other
/// than 0: rank 0 speaks for the run; errors still go to stderr).
pub fn set_quiet() {
    QUIET.store(true, Ordering::Relaxed);
}

/// Prints a warning line on stderr, unless [`set_quiet`] was called.
pub fn warn(line: fmt::Arguments<'_>) {
    if !QUIET.load(Ordering::Relaxed) {
        let _ = writeln!(io::stderr(), "warning: {line}");
    }
}

/// Writing a result to stdout failed.
#[derive(Debug, thiserror::Error)]
#[error("writing to stdout: {source}")]
pub struct StdoutError {
    /// The failed write's error.
    #[source]
    pub source: io::Error,
}

impl StdoutError {
    /// Whether the reader of stdout went away (`| head`), which a command ends on quietly.
    pub fn is_closed_pipe(&self) -> bool {
        self.source.kind() == io::ErrorKind::BrokenPipe
    }
}

/// Prints a progress line; after a failed write, notes it once on stderr and drops this and
/// every later line.
pub fn say(line: fmt::Arguments<'_>) {
    if STDOUT_LOST.load(Ordering::Relaxed) || QUIET.load(Ordering::Relaxed) {
        return;
    }
    if let Err(error) = write_line(line) {
        STDOUT_LOST.store(true, Ordering::Relaxed);
        // stderr may be gone too; nothing is left to tell then.
        let _ = writeln!(
            io::stderr(),
            "note: stdout cannot be written ({error}); the command goes on without printing (a training run still logs to metrics.jsonl)"
        );
    }
}

/// Prints a result line; a failed write is a [`StdoutError`].
pub fn emit(line: fmt::Arguments<'_>) -> Result<(), StdoutError> {
    write_line(line).map_err(|source| StdoutError { source })
}

fn write_line(line: fmt::Arguments<'_>) -> io::Result<()> {
    let mut out = io::stdout().lock();
    out.write_fmt(line)?;
    out.write_all(b"\n")?;
    out.flush()
}

/// `println!` for progress lines: see [`say`].
#[macro_export]
macro_rules! say {
    ($($arg:tt)*) => { $crate::console::say(format_args!($($arg)*)) };
}

/// `println!` for result lines, returning `Result<(), StdoutError>`: see [`emit`].
#[macro_export]
macro_rules! emit {
    ($($arg:tt)*) => { $crate::console::emit(format_args!($($arg)*)) };
}
