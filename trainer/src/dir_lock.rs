//! One writer per output directory: an advisory lock (`flock`, through std's
//! `File::try_lock`) on `<dir>/.lock`, taken by every command that writes into a directory —
//! `train` (fresh or `--resume`), `train-image`, `prepare`, `export`, `analyze`, and
//! `compare` on its tree and on each of its runs. A second writer is refused at once with a
//! [`DirInUse`] error naming the holder, whose pid and command line the lock file holds.
//!
//! The OS drops the lock when its holder exits, even by `kill -9`, so a `.lock` file left
//! behind blocks nothing; it is not removed (removing it on release would let two writers
//! lock two different files). Temporary files are named per process
//! ([`crate::safetensors_io::temp_path_for`]); the strays of a killed writer are removed by
//! the next holder of the lock.

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

/// The lock file inside a locked directory.
pub const LOCK_FILE: &str = ".lock";

/// Another process holds the directory's lock.
#[derive(Debug, thiserror::Error)]
#[error(
    "{} is in use by {holder}: one writer per directory (wait for it to end, or choose another directory)",
    dir.display()
)]
pub struct DirInUse {
    /// The directory asked for.
    pub dir: PathBuf,
    /// The holder as its lock file names it: `process <pid> (<command line>)`.
    pub holder: String,
}

/// The lock on one directory, held until dropped.
#[derive(Debug)]
pub struct DirLock {
    _file: File,
    dir: PathBuf,
    /// The outermost directory [`DirLock::acquire`] created, if it created any.
    created: Option<PathBuf>,
}

impl DirLock {
    /// Locks `dir` for this process, creating it (and its missing parents) when needed; a
    /// [`DirInUse`] error when another process holds it. Stray temporary files of a killed
    /// writer are removed.
    pub fn acquire(dir: &Path) -> Result<DirLock> {
        let created = outermost_missing(dir);
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let path = dir.join(LOCK_FILE);
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .with_context(|| format!("opening the lock file {}", path.display()))?;
        match file.try_lock() {
            Ok(()) => {}
            Err(fs::TryLockError::WouldBlock) => {
                let mut holder = String::new();
                let _ = file.read_to_string(&mut holder);
                let holder = holder.trim();
                let holder = if holder.is_empty() { "another process".to_string() } else { holder.to_string() };
                return Err(DirInUse { dir: dir.to_path_buf(), holder }.into());
            }
            Err(fs::TryLockError::Error(error)) => {
                return Err(error).with_context(|| format!("locking {}", path.display()));
            }
        }
        let command: Vec<String> = std::env::args().collect();
        file.set_len(0)
            .and_then(|()| writeln!(file, "process {} ({})", std::process::id(), command.join(" ")))
            .with_context(|| format!("writing the lock file {}", path.display()))?;
        let lock = DirLock { _file: file, dir: dir.to_path_buf(), created };
        remove_stray_temps(dir)?;
        Ok(lock)
    }
}

impl Drop for DirLock {
    /// A command that created the directory and wrote nothing into it leaves none behind.
    fn drop(&mut self) {
        let Some(outermost) = &self.created else { return };
        let only_the_lock = fs::read_dir(&self.dir)
            .map(|entries| entries.filter_map(|e| e.ok()).all(|e| e.file_name() == LOCK_FILE))
            .unwrap_or(false);
        if !only_the_lock || fs::remove_file(self.dir.join(LOCK_FILE)).is_err() {
            return;
        }
        // Best effort, innermost first; `remove_dir` leaves a directory that is not empty.
        for dir in self.dir.ancestors() {
            if fs::remove_dir(dir).is_err() || dir == outermost {
                break;
            }
        }
    }
}

/// The outermost ancestor of `dir` (itself included) that does not exist yet.
fn outermost_missing(dir: &Path) -> Option<PathBuf> {
    dir.ancestors().filter(|a| !a.as_os_str().is_empty()).take_while(|a| !a.exists()).last().map(Path::to_path_buf)
}

/// Removes the temporary files (`<name>.<pid>.tmp`) that killed writers left in `dir`.
fn remove_stray_temps(dir: &Path) -> Result<()> {
    let entries = fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))?;
    for entry in entries.filter_map(|e| e.ok()) {
        let name = entry.file_name();
        let is_stray = name
            .to_str()
            .and_then(|n| n.strip_suffix(".tmp"))
            .and_then(|n| n.rsplit_once('.'))
            .is_some_and(|(_, pid)| !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit()));
        if is_stray && entry.file_type().is_ok_and(|t| t.is_file()) {
            let path = entry.path();
            fs::remove_file(&path).with_context(|| format!("removing the stray temporary file {}", path.display()))?;
        }
    }
    Ok(())
}
