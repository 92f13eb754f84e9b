//! A CUDA graph's capture on the emulated device (`graph.rs`): each piece of work the
//! captured step queues, recorded instead of run (a launch with its arguments, a cuBLAS
//! product, a memset, a device copy, each with the addresses it touches), and the poisoning
//! of every block the step reused (`allocator.rs`); a replay runs the record in order.

use std::sync::{Mutex, MutexGuard};

use super::memory::{self, LiveBuffer, POISON};
use super::Emulator;
use crate::cuda::error::Result;

/// Emulated device work, run again at each replay.
pub(crate) type EmulatedWork = Box<dyn Fn(&Emulator) -> Result<()> + Send + Sync>;

/// One piece of emulated work a capture recorded.
pub(crate) enum Node {
    /// Device work: its name, the device addresses it touches, the buffers they were in at
    /// the capture, and how to run it.
    Work { name: &'static str, addresses: Vec<u64>, buffers: Vec<LiveBuffer>, run: EmulatedWork },
    /// The poisoning of a block the capture's step reused: `bytes` from `start`.
    Poison { start: u64, bytes: usize },
}

impl Node {
    /// A piece of work's name and the device addresses it touches (none for a poisoning).
    pub(crate) fn touches(&self) -> Option<(&'static str, &[u64])> {
        match self {
            Node::Work { name, addresses, .. } => Some((name, addresses)),
            Node::Poison { .. } => None,
        }
    }
}

/// The emulated work of a capture, in the order it was queued.
#[derive(Default)]
pub(crate) struct Recording {
    nodes: Mutex<Vec<Node>>,
}

impl Recording {
    fn lock(&self) -> MutexGuard<'_, Vec<Node>> {
        self.nodes.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Records work `name` touching `addresses`.
    pub(crate) fn work(&self, name: &'static str, addresses: Vec<u64>, run: EmulatedWork) {
        let buffers = addresses.iter().filter_map(|&address| memory::containing(address)).collect();
        self.lock().push(Node::Work { name, addresses, buffers, run });
    }

    /// Records the poisoning of the block `(start, bytes)`.
    pub(crate) fn poison(&self, (start, bytes): (u64, usize)) {
        self.lock().push(Node::Poison { start, bytes });
    }

    /// The record so far, taken out.
    pub(crate) fn take(&self) -> Vec<Node> {
        std::mem::take(&mut *self.lock())
    }
}

/// Runs a record in order: each piece of work with the buffers it touched at the capture
/// registered again for as long as it runs (so the launch's checks see them as the capture
/// did, though the step has dropped them since), and each poisoning where the step reused
/// its block.
///
/// # Safety
/// Every address the record touches must still be mapped device memory that no one else
/// uses: a live buffer, or a block of the pool of the graph the record belongs to.
pub(crate) unsafe fn run(nodes: &[Node], emulator: &Emulator) -> Result<()> {
    for node in nodes {
        match node {
            Node::Work { run, buffers, .. } => {
                let revived: Vec<u64> = buffers.iter().filter(|&&b| memory::revive(b)).map(|b| b.ptr).collect();
                let ran = run(emulator);
                revived.into_iter().for_each(memory::unregister);
                ran?;
            }
            // SAFETY: the block is the graph's (the caller's promise), written only here.
            Node::Poison { start, bytes } => unsafe { std::ptr::write_bytes(*start as *mut u8, POISON, *bytes) },
        }
    }
    Ok(())
}
