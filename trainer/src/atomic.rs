//! Atomic file replacement: the bytes go to `<name>.<pid>.tmp` beside the destination, are
//! fsynced, renamed over it, and the directory is fsynced. A crash or a kill at any point
//! leaves the previous file or the new one, never a torn mix. The temp name is unique per
//! process, so two writers never share one; the commands hold a directory lock
//! ([`crate::dir_lock`]) whose next holder removes a killed writer's strays.
//!
//! Outputs made of several files (`prepare`'s `train.bin` + `val.bin`, `export`'s directory)
//! are replaced as a set: each file is [`stage`]d (written and fsynced at its temp path), and
//! only when every one is on disk are they renamed ([`commit_all`]), so a writer stopped
//! while writing (a full disk, a kill) leaves the whole previous set. Only a crash between
//! the renames themselves, which write no data, could mix the two sets.

use std::fs::{self, File};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

/// The temp path this process writes `path` through: `<file name>.<pid>.tmp` in the same
/// directory, so that the final rename never crosses a filesystem and no two processes
/// share a temp file.
pub fn temp_path_for(path: &Path) -> Result<PathBuf> {
    let name = path.file_name().with_context(|| format!("{} does not name a file", path.display()))?;
    let mut tmp_name = name.to_os_string();
    tmp_name.push(format!(".{}.tmp", std::process::id()));
    Ok(path.with_file_name(tmp_name))
}

/// A file written and fsynced at its temp path, not yet renamed over its destination; the
/// temp file is removed if it is dropped uncommitted.
#[must_use = "a staged file replaces nothing until it is committed"]
#[derive(Debug)]
pub struct Staged {
    tmp: PathBuf,
    path: PathBuf,
    committed: bool,
}

/// Writes the new contents of `path` with `write` at `path`'s temp path (streaming is fine)
/// and fsyncs them; `path` itself is untouched until [`Staged::commit`]. On failure (or a
/// panic in `write`) the temp file is removed.
pub fn stage(path: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<Staged> {
    let staged = Staged::begin(path)?;
    write(&staged.tmp)
        .and_then(|()| {
            File::open(&staged.tmp)
                .and_then(|f| f.sync_all())
                .with_context(|| format!("flushing {} to disk", staged.tmp.display()))
        })
        .with_context(|| format!("writing {} (left unchanged)", path.display()))?;
    Ok(staged)
}

impl Staged {
    /// A staged replacement of `path` whose temp file ([`Staged::tmp_path`]) the caller
    /// creates, fills and fsyncs itself (a writer that streams and seeks).
    pub fn begin(path: &Path) -> Result<Staged> {
        Ok(Staged { tmp: temp_path_for(path)?, path: path.to_path_buf(), committed: false })
    }

    /// Where the new contents go until the commit.
    pub fn tmp_path(&self) -> &Path {
        &self.tmp
    }

    /// Renames the staged file over its destination and makes the rename durable.
    pub fn commit(mut self) -> Result<()> {
        fs::rename(&self.tmp, &self.path)
            .with_context(|| format!("renaming {} to {}", self.tmp.display(), self.path.display()))
            .with_context(|| format!("writing {} (left unchanged)", self.path.display()))?;
        self.committed = true;
        sync_parent_dir(&self.path)
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        if !self.committed {
            // Best effort: the error that matters is the one that stopped the commit.
            let _ = fs::remove_file(&self.tmp);
        }
    }
}

/// Commits every staged file, in order: call once all of a set are staged.
pub fn commit_all(staged: Vec<Staged>) -> Result<()> {
    staged.into_iter().try_for_each(Staged::commit)
}

/// Replaces `path` atomically with what `write` puts at the temp path it is given: [`stage`],
/// then [`Staged::commit`]. On any failure `path` is untouched and no temp file stays.
pub fn atomic_replace(path: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    stage(path, write)?.commit()
}

/// Writes `bytes` to `path` atomically ([`atomic_replace`]). Used for JSON configs and other
/// small files beside checkpoints.
pub fn atomic_write(path: &Path, bytes: &[u8]) -> Result<()> {
    atomic_replace(path, |tmp| fs::write(tmp, bytes).with_context(|| format!("writing {}", tmp.display())))
}

/// Makes the rename itself durable: without it a power loss can forget the new directory entry.
#[cfg(unix)]
fn sync_parent_dir(path: &Path) -> Result<()> {
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    File::open(dir).and_then(|d| d.sync_all()).with_context(|| format!("flushing directory {} to disk", dir.display()))
}

/// Directories cannot be opened for fsync on this platform; the rename is as durable as the
/// OS makes it.
#[cfg(not(unix))]
fn sync_parent_dir(_path: &Path) -> Result<()> {
    Ok(())
}
