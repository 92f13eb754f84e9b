//! Opening an input that must be a regular file because it is memory-mapped (token files,
//! checkpoints): a directory, a FIFO or a device is refused by name before `open`, which
//! would block forever on a FIFO that no process writes to.

use std::fs::File;
use std::path::Path;

use anyhow::{ensure, Context, Result};

/// Opens the `what` (e.g. "token file") at `path`; returns it with its length in bytes.
pub fn open_regular(path: &Path, what: &str) -> Result<(File, u64)> {
    let metadata = std::fs::metadata(path).with_context(|| format!("opening {what} {}", path.display()))?;
    ensure!(!metadata.is_dir(), "{} is a directory, not a {what}", path.display());
    ensure!(metadata.is_file(), "{} is not a regular file (a FIFO or a device?); a {what} must be one", path.display());
    let file = File::open(path).with_context(|| format!("opening {what} {}", path.display()))?;
    Ok((file, metadata.len()))
}
