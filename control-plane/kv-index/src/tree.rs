//! The prefix tree, path-compressed: a node is a run of consecutive blocks with one owner set.
//!
//! A conversation's own blocks, or a system prompt every rank shares, form one run, so walking,
//! owning or matching them costs one node touch and one owner-set touch for the whole run
//! instead of one per block. A run is split only where owners diverge (a rank holds part of
//! it) or a branch starts mid-run, and is not joined again with its neighbours when their
//! owners converge; a leaf owned by one rank grows in place when that rank extends its chain.
//!
//! A run's tokens hashes live in a segment (a `Vec<u64>` per chain as first stored). Runs view
//! consecutive ranges of their segment, and a block's identity is its segment and offset
//! ([`BlockRef`]): splitting a run changes no block's identity, so the ranks' lookups, which
//! name blocks, never need rewriting. A segment's runs always cover it from offset 0 with no
//! gap, each the parent of the next, so only its last run can be freed (its ancestors are the
//! others): freeing truncates the segment, and no dead hash outlives its block.
//!
//! Runs and segments live in fixed-size chunks addressed by `u32` (a growing `Vec` would keep up
//! to half its capacity idle after a doubling; a chunk wastes at most one chunk). A run's first
//! child is linked from the run itself; further children go in one table mapping
//! `(parent, first tokens_hash)` to the child, 16 bytes an entry; a run's children are also a
//! list (from the first, through their sibling links), so a subtree can be walked. A run lives
//! while some rank owns it; one whose last owner leaves while it has children is an orphan
//! ([`Tree::take_orphans`]): the index drops everything under it, as Dynamo's router does, and
//! it goes with them. Freed slots are reused.

use hashbrown::HashTable;

use crate::hash::Mixer;
use crate::owners::Owners;

pub(crate) const ROOT: u32 = 0;
const CHUNK_BITS: u32 = 12;
const CHUNK: usize = 1 << CHUNK_BITS;
const FREED: u32 = u32::MAX;
const NONE: u32 = u32::MAX;
/// A segment grows to at most this many blocks; a longer chain continues in a new one. Bounds
/// the cost of finding and inserting a run in its segment's sorted list.
const SEGMENT_CAP: usize = 1024;

/// One block's identity: its segment and offset there, unchanged when runs split.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct BlockRef {
    pub(crate) segment: u32,
    pub(crate) offset: u32,
}

impl BlockRef {
    pub(crate) fn key(self) -> u64 {
        (u64::from(self.segment) << 32) | u64::from(self.offset)
    }

    pub(crate) fn from_key(key: u64) -> BlockRef {
        BlockRef { segment: (key >> 32) as u32, offset: key as u32 }
    }
}

#[derive(Debug, Default)]
struct Run {
    /// The tokens hash of the run's first block, copied here so finding a child needs no
    /// segment access.
    first_hash: u64,
    segment: u32,
    start: u32,
    len: u32,
    /// `FREED` while the slot is on the free list.
    parent: u32,
    /// All children: `first_child` (if not `NONE`) and those in the edge table.
    children: u32,
    /// The child linked from here rather than from the table, and the first of the list of
    /// all of them.
    first_child: u32,
    /// The next and the previous child of the parent's list (`NONE` at its ends).
    next_sibling: u32,
    prev_sibling: u32,
    owners: Owners,
}

#[derive(Debug, Default)]
struct Segment {
    hashes: Vec<u64>,
    /// `(start, run)` of the runs viewing this segment, ascending by start, the first at 0, each
    /// ending where the next starts and the last at `hashes.len()`. Empty while free.
    runs: Vec<(u32, u32)>,
}

impl Segment {
    fn heap_bytes(&self) -> usize {
        self.hashes.capacity() * size_of::<u64>() + self.runs.capacity() * size_of::<(u32, u32)>()
    }

    /// Index in `runs` of the run holding `offset`.
    fn run_index(&self, offset: u32) -> usize {
        self.runs.partition_point(|(start, _)| *start <= offset).saturating_sub(1)
    }
}

#[derive(Debug, Clone, Copy)]
struct Edge {
    tokens_hash: u64,
    parent: u32,
    child: u32,
}

/// Fixed-size chunks of slots addressed by `u32`, with a free list.
#[derive(Debug)]
struct Arena<T> {
    chunks: Vec<Vec<T>>,
    free: Vec<u32>,
}

impl<T> Arena<T> {
    fn new() -> Arena<T> {
        Arena { chunks: Vec::new(), free: Vec::new() }
    }

    fn alloc(&mut self, value: T) -> u32 {
        if let Some(slot) = self.free.pop() {
            *self.get_mut(slot) = value;
            return slot;
        }
        if self.chunks.last().is_none_or(|chunk| chunk.len() == CHUNK) {
            self.chunks.push(Vec::with_capacity(CHUNK));
        }
        let chunk_index = self.chunks.len() - 1;
        let chunk = &mut self.chunks[chunk_index];
        let id = (chunk_index << CHUNK_BITS) + chunk.len();
        chunk.push(value);
        // Limits::clamped keeps the block count (and so runs and segments) below u32::MAX.
        u32::try_from(id).unwrap_or(FREED)
    }

    fn release(&mut self, id: u32) {
        self.free.push(id);
    }

    #[inline]
    fn get(&self, id: u32) -> &T {
        &self.chunks[(id >> CHUNK_BITS) as usize][id as usize & (CHUNK - 1)]
    }

    #[inline]
    fn get_mut(&mut self, id: u32) -> &mut T {
        &mut self.chunks[(id >> CHUNK_BITS) as usize][id as usize & (CHUNK - 1)]
    }

    fn heap_bytes(&self) -> usize {
        self.chunks.capacity() * size_of::<Vec<T>>()
            + self.chunks.len() * CHUNK * size_of::<T>()
            + self.free.capacity() * size_of::<u32>()
    }

    #[cfg(test)]
    fn slots(&self) -> usize {
        self.chunks.iter().map(Vec::len).sum()
    }
}

#[derive(Debug)]
pub(crate) struct Tree {
    runs: Arena<Run>,
    segments: Arena<Segment>,
    edges: HashTable<Edge>,
    /// Live blocks, the root excluded.
    blocks: usize,
    /// Live runs, the root excluded.
    live_runs: usize,
    mixer: Mixer,
    /// Bytes held by owner lists that spilled to the heap and by segments, kept current.
    spilled: usize,
    /// Runs left without owners while they had children since the last
    /// [`Tree::take_orphans`] (some may have been owned or freed since).
    orphans: Vec<u32>,
}

impl Tree {
    pub(crate) fn new(mixer: Mixer) -> Tree {
        let mut tree = Tree {
            runs: Arena::new(),
            segments: Arena::new(),
            edges: HashTable::new(),
            blocks: 0,
            live_runs: 0,
            mixer,
            spilled: 0,
            orphans: Vec::new(),
        };
        tree.runs.alloc(Run {
            parent: FREED,
            first_child: NONE,
            next_sibling: NONE,
            prev_sibling: NONE,
            ..Run::default()
        });
        tree
    }

    /// Live blocks, the root excluded.
    pub(crate) fn blocks(&self) -> usize {
        self.blocks
    }

    /// Live runs, the root excluded.
    pub(crate) fn runs(&self) -> usize {
        self.live_runs
    }

    #[inline]
    pub(crate) fn len(&self, run: u32) -> u32 {
        self.runs.get(run).len
    }

    /// The run's tokens hashes.
    #[inline]
    pub(crate) fn hashes(&self, run: u32) -> &[u64] {
        let r = self.runs.get(run);
        if r.len == 0 {
            return &[];
        }
        let start = r.start as usize;
        &self.segments.get(r.segment).hashes[start..start + r.len as usize]
    }

    #[inline]
    pub(crate) fn hash_at(&self, run: u32, index: u32) -> u64 {
        let r = self.runs.get(run);
        self.segments.get(r.segment).hashes[(r.start + index) as usize]
    }

    #[inline]
    pub(crate) fn block_ref(&self, run: u32, index: u32) -> BlockRef {
        let r = self.runs.get(run);
        BlockRef { segment: r.segment, offset: r.start + index }
    }

    /// The run holding `block` and the block's index in it.
    #[inline]
    pub(crate) fn locate(&self, block: BlockRef) -> (u32, u32) {
        let segment = self.segments.get(block.segment);
        let (start, run) = segment.runs[segment.run_index(block.offset)];
        (run, block.offset - start)
    }

    #[inline]
    pub(crate) fn child(&self, parent: u32, tokens_hash: u64) -> Option<u32> {
        let p = self.runs.get(parent);
        let mut in_table = p.children;
        if p.first_child != NONE {
            if self.runs.get(p.first_child).first_hash == tokens_hash {
                return Some(p.first_child);
            }
            in_table -= 1;
        }
        if in_table == 0 {
            return None;
        }
        let hash = self.mixer.pair(tokens_hash, parent);
        self.edges.find(hash, |e| e.parent == parent && e.tokens_hash == tokens_hash).map(|e| e.child)
    }

    #[inline]
    pub(crate) fn owners(&self, run: u32) -> &Owners {
        &self.runs.get(run).owners
    }

    /// Creates a one-block run under `parent` starting a new segment (with room for `expected`
    /// blocks), owned by `rank`. The caller checked the child is absent and the ceilings allow it.
    pub(crate) fn add_run(&mut self, parent: u32, tokens_hash: u64, expected: usize, rank: u32) -> u32 {
        let mut hashes = Vec::with_capacity(expected.clamp(1, SEGMENT_CAP));
        hashes.push(tokens_hash);
        let segment = self.segments.alloc(Segment { hashes, runs: Vec::with_capacity(1) });
        let run = self.runs.alloc(Run {
            first_hash: tokens_hash,
            segment,
            start: 0,
            len: 1,
            parent,
            children: 0,
            first_child: NONE,
            next_sibling: NONE,
            prev_sibling: NONE,
            owners: Owners::One(rank),
        });
        let s = self.segments.get_mut(segment);
        s.runs.push((0, run));
        self.spilled += s.heap_bytes();
        self.blocks += 1;
        self.live_runs += 1;
        self.link(parent, tokens_hash, run);
        run
    }

    /// Appends a block to `run` if that keeps every invariant: a leaf owned by `rank` alone, the
    /// last of its segment, with room left.
    pub(crate) fn try_extend(&mut self, run: u32, rank: u32, tokens_hash: u64) -> bool {
        if run == ROOT {
            return false;
        }
        let r = self.runs.get(run);
        if r.children != 0 || !matches!(r.owners, Owners::One(only) if only == rank) {
            return false;
        }
        let (segment, end) = (r.segment, (r.start + r.len) as usize);
        let s = self.segments.get_mut(segment);
        if s.hashes.len() != end || end >= SEGMENT_CAP {
            return false;
        }
        let before = s.hashes.capacity();
        s.hashes.push(tokens_hash);
        self.spilled = self.spilled + s.hashes.capacity() * size_of::<u64>() - before * size_of::<u64>();
        self.runs.get_mut(run).len += 1;
        self.blocks += 1;
        true
    }

    /// Splits `run` before its block `at` (`0 < at < len`): the blocks before move to a new run
    /// (returned) with the same owners; `run` keeps the rest and its children.
    pub(crate) fn split(&mut self, run: u32, at: u32) -> u32 {
        let r = self.runs.get(run);
        debug_assert!(at > 0 && at < r.len);
        let (segment, start, parent, first_hash) = (r.segment, r.start, r.parent, r.first_hash);
        let owners = r.owners.clone();
        self.spilled += owners.heap_bytes();
        let orphan = owners.is_empty();
        let prefix = self.runs.alloc(Run {
            first_hash,
            segment,
            start,
            len: at,
            parent,
            children: 1,
            first_child: run,
            next_sibling: NONE,
            prev_sibling: NONE,
            owners,
        });
        if orphan {
            self.orphans.push(prefix);
        }
        self.relink(parent, first_hash, run, prefix);
        let s = self.segments.get_mut(segment);
        let index = s.run_index(start);
        s.runs[index].1 = prefix;
        let before = s.runs.capacity();
        s.runs.insert(index + 1, (start + at, run));
        let next_hash = s.hashes[(start + at) as usize];
        self.spilled = self.spilled + s.runs.capacity() * size_of::<(u32, u32)>() - before * size_of::<(u32, u32)>();
        let r = self.runs.get_mut(run);
        r.start += at;
        r.len -= at;
        r.parent = prefix;
        r.first_hash = next_hash;
        self.live_runs += 1;
        prefix
    }

    /// Adds `rank` to the owners of blocks `from..to` of `run`, splitting it so that range is a
    /// run of its own; returns that run.
    pub(crate) fn add_owner_range(&mut self, run: u32, from: u32, to: u32, rank: u32) -> u32 {
        if from > 0 {
            self.split(run, from);
        }
        let middle = if to - from < self.len(run) { self.split(run, to - from) } else { run };
        self.edit_owners(middle, |owners| owners.insert(rank));
        middle
    }

    /// Drops `rank`'s ownership of one block, then frees what is left without owners and
    /// children.
    pub(crate) fn remove_block_owner(&mut self, block: BlockRef, rank: u32) {
        let (run, index) = self.locate(block);
        let r = self.runs.get(run);
        if index + 1 == r.len && r.len > 1 && r.children == 0 && matches!(r.owners, Owners::One(only) if only == rank) {
            // The tail of a leaf only this rank owns (an engine evicting a leaf): just shorten it.
            self.runs.get_mut(run).len -= 1;
            self.blocks -= 1;
            self.truncate_segment(block.segment, block.offset);
            return;
        }
        if index > 0 {
            self.split(run, index);
        }
        let single = if self.len(run) > 1 { self.split(run, 1) } else { run };
        self.remove_owner(single, rank);
    }

    /// Gives back the room `run`'s segment kept for blocks that were then refused.
    pub(crate) fn trim(&mut self, run: u32) {
        if run == ROOT {
            return;
        }
        let s = self.segments.get_mut(self.runs.get(run).segment);
        if s.hashes.capacity() > 2 * s.hashes.len() {
            let before = s.heap_bytes();
            s.hashes.shrink_to_fit();
            self.spilled = self.spilled + s.heap_bytes() - before;
        }
    }

    /// Drops `rank` from a whole run's owners (the rank holds none of its blocks any more), then
    /// frees what is left without owners and children; a run left without owners that has
    /// children is noted as an orphan.
    pub(crate) fn remove_owner(&mut self, run: u32, rank: u32) {
        if !self.edit_owners(run, |owners| owners.remove(rank)) {
            return;
        }
        let r = self.runs.get(run);
        if r.owners.is_empty() && r.children > 0 {
            self.orphans.push(run);
        } else {
            self.prune(run);
        }
    }

    /// The runs that are orphans now (no owner, children), each once, forgetting the rest of
    /// those noted: what [`Tree::descendants`] and [`Tree::free_subtree`] are for.
    pub(crate) fn take_orphans(&mut self) -> Vec<u32> {
        let mut orphans = std::mem::take(&mut self.orphans);
        orphans.sort_unstable();
        orphans.dedup();
        orphans.retain(|&run| {
            let r = self.runs.get(run);
            run != ROOT && r.parent != FREED && r.owners.is_empty() && r.children > 0
        });
        orphans
    }

    /// Every run below `run`, each after its parent.
    pub(crate) fn descendants(&self, run: u32) -> Vec<u32> {
        let mut found = Vec::new();
        let mut stack = vec![self.runs.get(run).first_child];
        while let Some(child) = stack.pop() {
            if child == NONE {
                continue;
            }
            let c = self.runs.get(child);
            found.push(child);
            stack.push(c.next_sibling);
            stack.push(c.first_child);
        }
        found
    }

    /// Frees `below` (an orphan's [`Tree::descendants`], its owners already told), then the
    /// orphan and every ancestor left without owners and children.
    pub(crate) fn free_subtree(&mut self, orphan: u32, below: &[u32]) {
        for &run in below {
            self.edit_owners(run, |owners| {
                *owners = Owners::Empty;
                true
            });
        }
        // Children before parents: each run is childless, and its segment's last, when freed.
        for &run in below.iter().rev().chain([orphan].iter()) {
            if self.runs.get(run).parent != FREED {
                self.prune(run);
            }
        }
    }

    /// The blocks of `run`: its segment and their offsets there.
    pub(crate) fn blocks_of(&self, run: u32) -> (u32, std::ops::Range<u32>) {
        let r = self.runs.get(run);
        (r.segment, r.start..r.start + r.len)
    }

    pub(crate) fn heap_bytes(&self) -> usize {
        self.runs.heap_bytes() + self.segments.heap_bytes() + self.edges.allocation_size() + self.spilled
    }

    fn edit_owners(&mut self, run: u32, edit: impl FnOnce(&mut Owners) -> bool) -> bool {
        let owners = &mut self.runs.get_mut(run).owners;
        let before = owners.heap_bytes();
        let changed = edit(owners);
        let after = owners.heap_bytes();
        self.spilled = self.spilled + after - before;
        changed
    }

    fn link(&mut self, parent: u32, tokens_hash: u64, child: u32) {
        let p = self.runs.get_mut(parent);
        p.children += 1;
        let head = p.first_child;
        if head == NONE {
            p.first_child = child;
            return;
        }
        // Listed second, after the first child (which stays the one linked from the parent).
        let after = self.runs.get(head).next_sibling;
        let c = self.runs.get_mut(child);
        (c.prev_sibling, c.next_sibling) = (head, after);
        self.runs.get_mut(head).next_sibling = child;
        if after != NONE {
            self.runs.get_mut(after).prev_sibling = child;
        }
        let mixer = self.mixer;
        let hash = mixer.pair(tokens_hash, parent);
        self.edges.insert_unique(hash, Edge { tokens_hash, parent, child }, |e| mixer.pair(e.tokens_hash, e.parent));
    }

    /// Puts `new` in `old`'s place among `parent`'s children (`old`'s first tokens hash is
    /// `tokens_hash`); `old` is left unlisted.
    fn relink(&mut self, parent: u32, tokens_hash: u64, old: u32, new: u32) {
        let o = self.runs.get_mut(old);
        let (prev, next) = (o.prev_sibling, o.next_sibling);
        (o.prev_sibling, o.next_sibling) = (NONE, NONE);
        let n = self.runs.get_mut(new);
        (n.prev_sibling, n.next_sibling) = (prev, next);
        if prev != NONE {
            self.runs.get_mut(prev).next_sibling = new;
        }
        if next != NONE {
            self.runs.get_mut(next).prev_sibling = new;
        }
        let p = self.runs.get_mut(parent);
        if p.first_child == old {
            p.first_child = new;
            return;
        }
        let hash = self.mixer.pair(tokens_hash, parent);
        if let Some(edge) = self.edges.find_mut(hash, |e| e.child == old) {
            edge.child = new;
        }
    }

    /// Drops the segment's hashes from `offset` on (its last run was shortened or freed), and
    /// gives memory back once most of it is idle.
    fn truncate_segment(&mut self, segment: u32, offset: u32) {
        let s = self.segments.get_mut(segment);
        let before = s.heap_bytes();
        s.hashes.truncate(offset as usize);
        if s.hashes.len() * 4 <= s.hashes.capacity() {
            s.hashes.shrink_to(s.hashes.len() * 2);
        }
        // Its run list too: removals in the middle split a segment into up to a run a block,
        // and a segment pruned back to one held block would otherwise keep that list's 8 KiB.
        if s.runs.len() * 4 <= s.runs.capacity() {
            s.runs.shrink_to(s.runs.len() * 2);
        }
        self.spilled = self.spilled + s.heap_bytes() - before;
    }

    fn prune(&mut self, mut run: u32) {
        while run != ROOT {
            let r = self.runs.get(run);
            if r.children > 0 || !r.owners.is_empty() {
                return;
            }
            let (parent, first_hash, segment, start, len) = (r.parent, r.first_hash, r.segment, r.start, r.len);
            let (prev, next) = (r.prev_sibling, r.next_sibling);
            let freed = self.runs.get_mut(run);
            freed.parent = FREED;
            freed.owners = Owners::Empty;
            (freed.prev_sibling, freed.next_sibling) = (NONE, NONE);
            self.runs.release(run);
            self.live_runs -= 1;
            self.blocks -= len as usize;
            // Only a segment's last run can be childless: drop it from the segment.
            let s = self.segments.get_mut(segment);
            s.runs.pop();
            if s.runs.is_empty() {
                self.spilled -= s.heap_bytes();
                *s = Segment::default();
                self.segments.release(segment);
            } else {
                self.truncate_segment(segment, start);
            }
            let p = self.runs.get_mut(parent);
            p.children -= 1;
            if p.first_child == run {
                // The next child takes its place as the one linked from the parent, out of the
                // table.
                p.first_child = next;
                if next != NONE {
                    let n = self.runs.get_mut(next);
                    n.prev_sibling = NONE;
                    let hash = self.mixer.pair(n.first_hash, parent);
                    if let Ok(entry) = self.edges.find_entry(hash, |e| e.child == next) {
                        entry.remove();
                    }
                }
            } else {
                let hash = self.mixer.pair(first_hash, parent);
                if let Ok(entry) = self.edges.find_entry(hash, |e| e.child == run) {
                    entry.remove();
                }
                self.runs.get_mut(prev).next_sibling = next;
                if next != NONE {
                    self.runs.get_mut(next).prev_sibling = prev;
                }
            }
            run = parent;
        }
    }
}

#[cfg(test)]
impl Tree {
    /// Checks the tree's own invariants and returns, per live block, its owners (for the index's
    /// cross-checks): every link names a live run whose parent and first tokens hash agree,
    /// child counts match the links, no live run is empty, ownerless and childless, segments
    /// are covered by their runs from 0 without gaps, owner lists are well formed, and the
    /// block, run and heap figures are current.
    pub(crate) fn check(&self) -> Vec<(BlockRef, Vec<u32>)> {
        let mut children = std::collections::HashMap::<u32, u32>::new();
        let mut live = Vec::new();
        let mut stack = vec![ROOT];
        while let Some(id) = stack.pop() {
            let first = self.runs.get(id).first_child;
            if first != NONE {
                assert_eq!(self.runs.get(first).parent, id, "first child {first} of {id} names another parent");
                *children.entry(id).or_default() += 1;
                live.push(first);
                stack.push(first);
            }
            for edge in self.edges.iter().filter(|e| e.parent == id) {
                assert!(first != edge.child, "child both linked and in the table");
                let run = self.runs.get(edge.child);
                assert_eq!((run.parent, run.first_hash), (edge.parent, edge.tokens_hash));
                *children.entry(id).or_default() += 1;
                live.push(edge.child);
                stack.push(edge.child);
            }
        }
        assert_eq!(live.len(), self.live_runs);
        let linked = live.iter().chain([ROOT].iter()).filter(|r| self.runs.get(**r).first_child != NONE).count();
        assert_eq!(self.edges.len() + linked, live.len(), "edges to unreachable runs");
        let mut spilled = 0;
        let mut blocks = 0;
        let mut segments = std::collections::BTreeSet::new();
        let mut result = Vec::new();
        for &id in live.iter().chain([ROOT].iter()) {
            let run = self.runs.get(id);
            assert_eq!(run.children, children.get(&id).copied().unwrap_or(0), "child count of {id}");
            run.owners.check();
            spilled += run.owners.heap_bytes();
            // Its children's list holds every child once, each naming it as parent.
            let mut listed = Vec::new();
            let mut child = run.first_child;
            let mut prev = NONE;
            while child != NONE {
                let c = self.runs.get(child);
                assert_eq!((c.parent, c.prev_sibling), (id, prev), "child {child} listed under {id}");
                listed.push(child);
                (prev, child) = (child, c.next_sibling);
            }
            assert_eq!(listed.len() as u32, run.children, "children listed under {id}");
            if id == ROOT {
                assert!(run.owners.is_empty());
                continue;
            }
            assert!(run.len > 0, "empty run {id}");
            assert!(!run.owners.is_empty(), "run {id} has no owner");
            assert_eq!(run.first_hash, self.hash_at(id, 0));
            blocks += run.len as usize;
            segments.insert(run.segment);
            let mut owners = Vec::new();
            run.owners.for_each(|o| owners.push(o));
            for i in 0..run.len {
                let block = self.block_ref(id, i);
                assert_eq!(self.locate(block), (id, i));
                result.push((block, owners.clone()));
            }
        }
        for &segment in &segments {
            let s = self.segments.get(segment);
            spilled += s.heap_bytes();
            assert_eq!(s.runs.first().map(|r| r.0), Some(0));
            for (i, &(start, run)) in s.runs.iter().enumerate() {
                let r = self.runs.get(run);
                assert_eq!((r.segment, r.start), (segment, start), "segment {segment} lists run {run}");
                let end = s.runs.get(i + 1).map_or(s.hashes.len() as u32, |next| next.0);
                assert_eq!(start + r.len, end, "gap in segment {segment}");
                if i > 0 {
                    assert_eq!(r.parent, s.runs[i - 1].1, "runs of a segment form a chain");
                }
            }
        }
        assert_eq!(spilled, self.spilled);
        assert_eq!(blocks, self.blocks);
        assert_eq!(self.runs.slots(), 1 + live.len() + self.runs.free.len(), "leaked runs");
        assert_eq!(self.segments.slots(), segments.len() + self.segments.free.len(), "leaked segments");
        result
    }
}
