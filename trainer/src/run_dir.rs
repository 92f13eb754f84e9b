//! Which directory a run writes into, so that no run is discarded without being asked: a
//! fresh run into a directory that holds one ([`holds_run`]) is refused unless it says
//! `--overwrite`; the bare command, whose directory is the default, moves on to the next
//! free `<dir>-2`, `<dir>-3`, ... instead. The directory is claimed with its lock
//! ([`DirLock`]) held, so two commands never pick the same one.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use crate::dir_lock::{DirInUse, DirLock};
use crate::train::{CHECKPOINT_FILE, CONFIG_FILE, METRICS_FILE};

/// Most numbered directories tried after the default one.
const MAX_NUMBERED: usize = 10_000;

/// How a run may treat the directory it is given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claim {
    /// Continue the run in the directory (`--resume`).
    Resume,
    /// Start a new run, replacing one that is there (`--overwrite`).
    Overwrite,
    /// Start a new run; a run in the directory is an error.
    Fresh,
    /// Start a new run in the default directory, or the next free numbered one.
    FreshDefault,
}

/// Whether `dir` holds (part of) a run: a checkpoint, a `config.json` or a `metrics.jsonl`.
pub fn holds_run(dir: &Path) -> bool {
    [CHECKPOINT_FILE, CONFIG_FILE, METRICS_FILE].iter().any(|file| dir.join(file).exists())
}

/// Locks the directory a run goes into and returns it: `dir` itself, or with
/// [`Claim::FreshDefault`] the first of `dir`, `dir-2`, `dir-3`, ... that holds no run and
/// is not in use. Errors when `dir` is in use, or holds a run that [`Claim::Fresh`] would discard.
pub fn claim(dir: &Path, how: Claim) -> Result<(PathBuf, DirLock)> {
    if how == Claim::FreshDefault {
        return claim_next_free(dir);
    }
    let lock = DirLock::acquire(dir)?;
    if how == Claim::Fresh && holds_run(dir) {
        bail!(
            "{} holds a run: pass --resume to continue it, --overwrite to replace it, or another --out-dir",
            dir.display()
        );
    }
    Ok((dir.to_path_buf(), lock))
}

fn claim_next_free(dir: &Path) -> Result<(PathBuf, DirLock)> {
    for n in 1..=MAX_NUMBERED {
        let candidate = if n == 1 { dir.to_path_buf() } else { numbered(dir, n) };
        let lock = match DirLock::acquire(&candidate) {
            Ok(lock) => lock,
            Err(error) if error.is::<DirInUse>() => continue,
            Err(error) => return Err(error),
        };
        if !holds_run(&candidate) {
            if n > 1 {
                crate::say!("{} holds a run: this one goes into {}", dir.display(), candidate.display());
            }
            return Ok((candidate, lock));
        }
    }
    bail!("{} and {MAX_NUMBERED} numbered directories beside it all hold runs: pass --out-dir", dir.display())
}

/// `dir` with `-n` appended to its last component.
fn numbered(dir: &Path, n: usize) -> PathBuf {
    let mut name = dir.file_name().unwrap_or(dir.as_os_str()).to_os_string();
    name.push(format!("-{n}"));
    dir.with_file_name(name)
}

impl Claim {
    /// The claim of a `train` / `train-image` command: its `--resume` and `--overwrite`
    /// flags, and whether the directory was named (by `--out-dir` or a `--config` file).
    pub fn from_flags(resume: bool, overwrite: bool, named: bool) -> Claim {
        match (resume, overwrite, named) {
            (true, _, _) => Claim::Resume,
            (false, true, _) => Claim::Overwrite,
            (false, false, true) => Claim::Fresh,
            (false, false, false) => Claim::FreshDefault,
        }
    }
}

/// Deletes the file at `path` if there is one: a new run drops what an old one left.
pub fn remove_if_present(path: &Path) -> Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(e).with_context(|| format!("removing the old {}", path.display()))
        }
        _ => Ok(()),
    }
}
