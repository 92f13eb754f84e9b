//! Where the caching allocator's buffers sit inside the memory it holds from the driver:
//! best fit, splitting and coalescing over *segments* (one driver allocation each), as
//! PyTorch's caching allocator does (`c10/cuda/CUDACachingAllocator.cpp`).
//!
//! Exact size classes (a free list per class, each block one driver allocation) hold, for
//! every class, the most blocks of it a step ever had live at once; the step's memory then
//! is the sum of those maxima, where it needs only the largest sum live at one moment. A
//! training step asks for different sizes in its forward (activations), at its loss (the
//! LM head's logits chunk) and in its backward (gradients), so the classes' maxima fall at
//! different moments: llama-60m Transponder, batch 8 × 256, held 2,118 MiB for a peak of
//! 1,736 in use. Segments let a gradient take the bytes an activation gave back.
//!
//! This module is the bookkeeping alone (offsets, no memory): `allocator.rs` gives each
//! segment its driver memory (or, on the emulated device, each buffer its own guarded host
//! block, so an access past a buffer still faults).
//!
//! - A request is rounded up to [`ALIGN`] bytes. Requests up to [`SMALL_REQUEST`] are served
//!   from segments of [`SMALL_SEGMENT`] bytes, others from large segments, so small buffers
//!   do not pin large segments.
//! - A request takes the smallest free block that holds it (ties: the oldest segment, the
//!   lowest offset; the choice is deterministic, so a step that repeats its requests repeats
//!   its placements). What is left of the block becomes a free block of its own when it is
//!   at least [`ALIGN`] bytes (small segments) or [`SMALL_REQUEST`] (large ones: smaller
//!   remnants would fragment them).
//! - A block given back merges with its free neighbours in its segment.
//! - When nothing fits, the caller adds a segment ([`segment_bytes`]): 2 MiB for small
//!   requests, 20 MiB for requests under 10 MiB, the request rounded up to 2 MiB otherwise.

use std::collections::{BTreeMap, BTreeSet};

/// Every request is rounded up to a multiple of this (also every offset's alignment).
const ALIGN: usize = 512;
/// Requests up to this many bytes are small.
const SMALL_REQUEST: usize = 1 << 20;
/// The driver allocation behind small requests.
const SMALL_SEGMENT: usize = 2 << 20;
/// Requests below this many bytes (and above [`SMALL_REQUEST`]) share segments of
/// [`MEDIUM_SEGMENT`] bytes.
const LARGE_REQUEST: usize = 10 << 20;
/// The driver allocation behind medium requests.
const MEDIUM_SEGMENT: usize = 20 << 20;
/// Large segments are a multiple of this.
const LARGE_GRANULE: usize = 2 << 20;

/// A buffer's bytes in a segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Placement {
    pub segment: u64,
    pub offset: usize,
    /// The block's bytes: the request rounded up, or the whole free block it took when the
    /// rest was too small to split off.
    pub bytes: usize,
}

/// The bytes a request for `bytes` is rounded to.
pub(crate) fn rounded(bytes: usize) -> usize {
    bytes.max(1).div_ceil(ALIGN) * ALIGN
}

/// The driver allocation to add when no free block holds a request for `bytes`.
pub(crate) fn segment_bytes(bytes: usize) -> usize {
    let bytes = rounded(bytes);
    if bytes <= SMALL_REQUEST {
        SMALL_SEGMENT
    } else if bytes < LARGE_REQUEST {
        MEDIUM_SEGMENT
    } else {
        bytes.div_ceil(LARGE_GRANULE) * LARGE_GRANULE
    }
}

/// Whether a request (or a segment) of `bytes` is small.
fn is_small(bytes: usize) -> bool {
    bytes <= SMALL_REQUEST
}

/// One segment: its size and its blocks by offset (bytes, free).
struct Segment {
    bytes: usize,
    small: bool,
    blocks: BTreeMap<usize, Block>,
}

#[derive(Clone, Copy)]
struct Block {
    bytes: usize,
    free: bool,
}

/// The segments held and their free blocks.
#[derive(Default)]
pub(crate) struct Segments {
    segments: BTreeMap<u64, Segment>,
    /// Free blocks as (bytes, segment, offset), one set per kind (small, large).
    free_small: BTreeSet<(usize, u64, usize)>,
    free_large: BTreeSet<(usize, u64, usize)>,
    free_bytes: usize,
}

impl Segments {
    /// The free blocks of the kind `small`.
    fn free_set(&mut self, small: bool) -> &mut BTreeSet<(usize, u64, usize)> {
        if small {
            &mut self.free_small
        } else {
            &mut self.free_large
        }
    }

    /// The smallest free block that holds `bytes`, split; `None` when none does (add a
    /// segment of [`segment_bytes`] and ask again).
    pub(crate) fn take(&mut self, bytes: usize) -> Option<Placement> {
        let wanted = rounded(bytes);
        let small = is_small(wanted);
        let &(found, segment, offset) = self.free_set(small).range((wanted, 0, 0)..).next()?;
        let split_at_least = if small { ALIGN } else { SMALL_REQUEST };
        let taken = if found - wanted >= split_at_least { wanted } else { found };
        self.take_at(Placement { segment, offset, bytes: taken })
    }

    /// The block at `placement` exactly, when its bytes lie in one free block (which is
    /// split around it); `None` otherwise: best fit's choice ([`Segments::take`]), or a
    /// placement of the last run that an arena repeats.
    pub(crate) fn take_at(&mut self, placement: Placement) -> Option<Placement> {
        let Placement { segment: id, offset, bytes } = placement;
        let segment = self.segments.get_mut(&id)?;
        let (&at, &block) = segment.blocks.range(..=offset).next_back()?;
        if !block.free || at + block.bytes < offset + bytes {
            return None;
        }
        let small = segment.small;
        segment.blocks.insert(offset, Block { bytes, free: false });
        let mut pieces = Vec::new();
        if at < offset {
            pieces.push((offset - at, id, at));
        }
        if offset + bytes < at + block.bytes {
            pieces.push((at + block.bytes - offset - bytes, id, offset + bytes));
        }
        for &(len, _, start) in &pieces {
            segment.blocks.insert(start, Block { bytes: len, free: true });
        }
        let free = self.free_set(small);
        free.remove(&(block.bytes, id, at));
        free.extend(pieces);
        self.free_bytes -= bytes;
        Some(placement)
    }

    /// Holds segment `id` (the caller's, unique across every `Segments` it keeps), made for
    /// a request of `request` bytes that nothing free held: all free, of
    /// [`segment_bytes`]`(request)` bytes (the caller's driver allocation).
    pub(crate) fn add(&mut self, id: u64, request: usize) {
        let (bytes, small) = (segment_bytes(request), is_small(rounded(request)));
        let blocks = BTreeMap::from([(0, Block { bytes, free: true })]);
        self.segments.insert(id, Segment { bytes, small, blocks });
        self.free_set(small).insert((bytes, id, 0));
        self.free_bytes += bytes;
    }

    /// Takes over `other`'s segments, free blocks and blocks in use (whose placements are
    /// then given back here).
    pub(crate) fn absorb(&mut self, other: Segments) {
        self.segments.extend(other.segments);
        self.free_small.extend(other.free_small);
        self.free_large.extend(other.free_large);
        self.free_bytes += other.free_bytes;
    }

    /// Frees the block at `placement`, merged with its free neighbours.
    pub(crate) fn give_back(&mut self, placement: Placement) {
        let Placement { segment: id, mut offset, mut bytes } = placement;
        let segment = self.segments.get_mut(&id).expect("a placement's segment is held");
        let small = segment.small;
        let mut merged = Vec::new();
        if let Some(next) = segment.blocks.get(&(offset + bytes)).copied().filter(|b| b.free) {
            segment.blocks.remove(&(offset + bytes));
            merged.push((next.bytes, id, offset + bytes));
            bytes += next.bytes;
        }
        let previous = segment.blocks.range(..offset).next_back().map(|(&at, &b)| (at, b));
        if let Some((at, before)) = previous.filter(|(_, b)| b.free) {
            segment.blocks.remove(&offset);
            merged.push((before.bytes, id, at));
            offset = at;
            bytes += before.bytes;
        }
        segment.blocks.insert(offset, Block { bytes, free: true });
        self.free_bytes += placement.bytes;
        let free = self.free_set(small);
        for block in merged {
            free.remove(&block);
        }
        free.insert((bytes, id, offset));
    }

    /// Stops holding every segment that is free as a whole; returns their ids and bytes.
    pub(crate) fn remove_free_segments(&mut self) -> Vec<(u64, usize)> {
        let whole: Vec<(u64, usize)> = self
            .segments
            .iter()
            .filter(|(_, s)| s.blocks.len() == 1 && s.blocks.values().all(|b| b.free))
            .map(|(&id, s)| (id, s.bytes))
            .collect();
        for &(id, bytes) in &whole {
            let small = self.segments.remove(&id).expect("listed above").small;
            self.free_set(small).remove(&(bytes, id, 0));
            self.free_bytes -= bytes;
        }
        whole
    }

    /// Bytes in free blocks.
    pub(crate) fn free_bytes(&self) -> usize {
        self.free_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Serves a request as the allocator does: a new segment when nothing fits (its id one
    /// past the largest held).
    fn serve(segments: &mut Segments, bytes: usize) -> Placement {
        segments.take(bytes).unwrap_or_else(|| {
            let id = segments.segments.keys().max().map_or(0, |last| last + 1);
            segments.add(id, bytes);
            segments.take(bytes).expect("a fresh segment holds its request")
        })
    }

    #[test]
    fn a_freed_block_is_taken_by_a_smaller_request_and_merges_back() {
        let mut segments = Segments::default();
        let big = serve(&mut segments, 40 << 20);
        assert_eq!((big.offset, big.bytes), (0, 40 << 20));
        segments.give_back(big);
        // Two smaller requests share the freed segment instead of adding one.
        let first = serve(&mut segments, 15 << 20);
        let second = serve(&mut segments, 15 << 20);
        assert_eq!((first.segment, second.segment), (big.segment, big.segment));
        assert_eq!(second.offset, 15 << 20);
        segments.give_back(first);
        segments.give_back(second);
        assert_eq!(segments.free_bytes(), 40 << 20);
        assert_eq!(segments.remove_free_segments(), vec![(big.segment, 40 << 20)]);
        assert_eq!(segments.free_bytes(), 0);
    }

    #[test]
    fn small_requests_stay_out_of_large_segments() {
        let mut segments = Segments::default();
        let large = serve(&mut segments, 40 << 20);
        segments.give_back(large);
        let small = serve(&mut segments, 4096);
        assert_ne!(small.segment, large.segment);
        assert_eq!(small.bytes, 4096);
    }

    #[test]
    fn a_remnant_too_small_to_split_off_stays_with_the_block() {
        let mut segments = Segments::default();
        let medium = serve(&mut segments, (20 << 20) - 4096);
        assert_eq!(medium.bytes, 20 << 20, "a 4 KiB remnant of a large segment is not split off");
    }

    #[test]
    fn a_placement_is_taken_again_exactly_where_it_was() {
        let mut segments = Segments::default();
        let first = serve(&mut segments, 30 << 20);
        let second = serve(&mut segments, 8 << 20);
        segments.give_back(first);
        segments.give_back(second);
        // Best fit would put 8 MiB at the start of the freed 30 MiB; the placement asked for
        // is in the middle of it, and the bytes around it stay free.
        let middle = Placement { segment: first.segment, offset: 10 << 20, bytes: 8 << 20 };
        assert_eq!(segments.take_at(middle), Some(middle));
        assert_eq!(segments.take_at(middle), None, "taken already");
        let before = serve(&mut segments, 10 << 20);
        assert_eq!((before.segment, before.offset), (first.segment, 0));
        let after = serve(&mut segments, 12 << 20);
        assert_eq!((after.segment, after.offset), (first.segment, 18 << 20));
        let elsewhere = Placement { segment: 99, offset: 0, bytes: 512 };
        assert_eq!(segments.take_at(elsewhere), None, "no such segment");
    }

    proptest! {
        /// Random requests and releases: live blocks never overlap, stay inside their
        /// segments, hold their requests, and the free bytes add up.
        #[test]
        fn live_blocks_never_overlap(ops in prop::collection::vec((any::<bool>(), 1usize..(24 << 20), any::<u16>()), 1..200)) {
            let mut segments = Segments::default();
            let mut live: Vec<(Placement, usize)> = Vec::new();
            for (allocate, bytes, pick) in ops {
                if allocate || live.is_empty() {
                    let bytes = if pick % 2 == 0 { bytes % (1 << 16) + 1 } else { bytes };
                    let placement = serve(&mut segments, bytes);
                    prop_assert!(placement.bytes >= bytes && placement.offset.is_multiple_of(ALIGN));
                    let segment_len = segments.segments[&placement.segment].bytes;
                    prop_assert!(placement.offset + placement.bytes <= segment_len);
                    for (other, _) in &live {
                        let apart = other.segment != placement.segment
                            || other.offset + other.bytes <= placement.offset
                            || placement.offset + placement.bytes <= other.offset;
                        prop_assert!(apart, "{placement:?} overlaps {other:?}");
                    }
                    live.push((placement, bytes));
                } else {
                    let (placement, _) = live.swap_remove(pick as usize % live.len());
                    segments.give_back(placement);
                }
                let held: usize = segments.segments.values().map(|s| s.bytes).sum();
                let in_use: usize = live.iter().map(|(p, _)| p.bytes).sum();
                prop_assert_eq!(held, in_use + segments.free_bytes());
            }
            for (placement, _) in live.drain(..) {
                segments.give_back(placement);
            }
            // Everything given back: every segment is one free block again.
            let held: usize = segments.segments.values().map(|s| s.bytes).sum();
            let released: usize = segments.remove_free_segments().iter().map(|&(_, b)| b).sum();
            prop_assert_eq!(released, held);
        }
    }
}
