//! The prefix tree: an arena of nodes keyed by `tokens_hash` from the root.
//!
//! Nodes live in fixed-size chunks addressed by `u32` (a growing `Vec` would keep up to half its
//! capacity idle after a doubling; a chunk wastes at most one chunk). A node's first child is
//! linked from the node itself, so a chain (the common shape: a conversation's own blocks) needs
//! no table at all, and extending one touches only the node just created. Further children go in
//! one table mapping `(parent, tokens_hash)` to the child, 16 bytes an entry, so a branch point
//! costs one probe whatever its fan-out. A node lives while some rank owns it or it has
//! children; freed slots are reused.

use hashbrown::HashTable;

use crate::hash::Mixer;
use crate::owners::Owners;

pub(crate) const ROOT: u32 = 0;
const CHUNK_BITS: u32 = 12;
const CHUNK: usize = 1 << CHUNK_BITS;
const FREED: u32 = u32::MAX;
const NONE: u32 = u32::MAX;

#[derive(Debug)]
struct Node {
    tokens_hash: u64,
    /// `FREED` while the slot is on the free list.
    parent: u32,
    /// All children: `first_child` (if not `NONE`) and those in the edge table.
    children: u32,
    /// The child linked from here rather than from the table.
    first_child: u32,
    owners: Owners,
}

impl Node {
    fn new(parent: u32, tokens_hash: u64) -> Node {
        Node { tokens_hash, parent, children: 0, first_child: NONE, owners: Owners::Empty }
    }
}

#[derive(Debug, Clone, Copy)]
struct Edge {
    tokens_hash: u64,
    parent: u32,
    child: u32,
}

#[derive(Debug)]
pub(crate) struct Tree {
    chunks: Vec<Vec<Node>>,
    free: Vec<u32>,
    edges: HashTable<Edge>,
    live: usize,
    mixer: Mixer,
    /// Bytes held by owner lists that spilled to the heap, kept current on every change.
    owner_heap: usize,
}

impl Tree {
    pub(crate) fn new(mixer: Mixer) -> Tree {
        let mut tree =
            Tree { chunks: Vec::new(), free: Vec::new(), edges: HashTable::new(), live: 0, mixer, owner_heap: 0 };
        tree.push(Node::new(FREED, 0));
        tree
    }

    /// Live nodes, the root excluded.
    pub(crate) fn len(&self) -> usize {
        self.live
    }

    #[inline]
    pub(crate) fn child(&self, parent: u32, tokens_hash: u64) -> Option<u32> {
        let p = self.node(parent);
        let mut in_table = p.children;
        if p.first_child != NONE {
            if self.node(p.first_child).tokens_hash == tokens_hash {
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

    /// Creates the child of `parent` for `tokens_hash`; the caller checked it is absent and that
    /// the node ceiling allows one more.
    pub(crate) fn add_child(&mut self, parent: u32, tokens_hash: u64) -> u32 {
        let node = Node::new(parent, tokens_hash);
        let child = match self.free.pop() {
            Some(slot) => {
                *self.node_mut(slot) = node;
                slot
            }
            None => self.push(node),
        };
        self.live += 1;
        let p = self.node_mut(parent);
        p.children += 1;
        if p.first_child == NONE {
            p.first_child = child;
            return child;
        }
        let mixer = self.mixer;
        let hash = mixer.pair(tokens_hash, parent);
        self.edges.insert_unique(hash, Edge { tokens_hash, parent, child }, |e| mixer.pair(e.tokens_hash, e.parent));
        child
    }

    pub(crate) fn owners(&self, node: u32) -> &Owners {
        &self.node(node).owners
    }

    /// Adds `rank` to `node`'s owners unless they number `max` already: `Some(true)` if added,
    /// `Some(false)` if it was one, `None` if full.
    pub(crate) fn add_owner(&mut self, node: u32, rank: u32, max: usize) -> Option<bool> {
        let mut added = None;
        self.edit_owners(node, |owners| {
            added = owners.try_insert(rank, max);
            added == Some(true)
        });
        added
    }

    /// Drops `rank`'s ownership of `node`, then frees `node` and every ancestor left without
    /// owners and children.
    pub(crate) fn remove_owner(&mut self, node: u32, rank: u32) -> bool {
        let removed = self.edit_owners(node, |owners| owners.remove(rank));
        if removed {
            self.prune(node);
        }
        removed
    }

    pub(crate) fn heap_bytes(&self) -> usize {
        self.chunks.capacity() * size_of::<Vec<Node>>()
            + self.chunks.len() * CHUNK * size_of::<Node>()
            + self.free.capacity() * size_of::<u32>()
            + self.edges.allocation_size()
            + self.owner_heap
    }

    fn edit_owners(&mut self, node: u32, edit: impl FnOnce(&mut Owners) -> bool) -> bool {
        let owners = &mut self.node_mut(node).owners;
        let before = owners.heap_bytes();
        let changed = edit(owners);
        let after = owners.heap_bytes();
        self.owner_heap = self.owner_heap + after - before;
        changed
    }

    fn prune(&mut self, mut node: u32) {
        while node != ROOT {
            let n = self.node(node);
            if n.children > 0 || !n.owners.is_empty() {
                return;
            }
            let (parent, tokens_hash) = (n.parent, n.tokens_hash);
            let freed = self.node_mut(node);
            freed.parent = FREED;
            freed.owners = Owners::Empty;
            self.free.push(node);
            self.live -= 1;
            let p = self.node_mut(parent);
            p.children -= 1;
            if p.first_child == node {
                p.first_child = NONE;
            } else {
                let hash = self.mixer.pair(tokens_hash, parent);
                if let Ok(entry) = self.edges.find_entry(hash, |e| e.child == node) {
                    entry.remove();
                }
            }
            node = parent;
        }
    }

    fn push(&mut self, node: Node) -> u32 {
        if self.chunks.last().is_none_or(|chunk| chunk.len() == CHUNK) {
            self.chunks.push(Vec::with_capacity(CHUNK));
        }
        let chunk_index = self.chunks.len() - 1;
        let chunk = &mut self.chunks[chunk_index];
        let id = (chunk_index << CHUNK_BITS) + chunk.len();
        chunk.push(node);
        // Limits::clamped keeps the node count below u32::MAX, so the id always fits.
        u32::try_from(id).unwrap_or(FREED)
    }

    fn node(&self, id: u32) -> &Node {
        &self.chunks[(id >> CHUNK_BITS) as usize][id as usize & (CHUNK - 1)]
    }

    fn node_mut(&mut self, id: u32) -> &mut Node {
        &mut self.chunks[(id >> CHUNK_BITS) as usize][id as usize & (CHUNK - 1)]
    }
}

#[cfg(test)]
impl Tree {
    /// Checks the tree's own invariants and returns, per live node, its owners (for the index's
    /// cross-checks): every edge names a live node whose parent and tokens hash agree, child
    /// counts match the edges, no live non-root node is both ownerless and childless, owner lists
    /// are strictly sorted, and the owner heap figure is current.
    pub(crate) fn check(&self) -> Vec<(u32, Vec<u32>)> {
        let mut children = std::collections::HashMap::<u32, u32>::new();
        let mut live = Vec::new();
        // Walk the first-child links from the root and every table child.
        let mut stack = vec![ROOT];
        let mut linked = Vec::new();
        while let Some(id) = stack.pop() {
            let first = self.node(id).first_child;
            if first != NONE {
                let node = self.node(first);
                assert_eq!(node.parent, id, "first child {first} of {id} names another parent");
                *children.entry(id).or_default() += 1;
                linked.push(first);
                stack.push(first);
            }
            stack.extend(self.edges.iter().filter(|e| e.parent == id).map(|e| e.child));
        }
        live.extend(&linked);
        for edge in &self.edges {
            assert!(self.node(edge.parent).first_child != edge.child, "child both linked and in the table");
            let node = self.node(edge.child);
            assert_ne!(node.parent, FREED, "edge to freed node {}", edge.child);
            assert_eq!((node.parent, node.tokens_hash), (edge.parent, edge.tokens_hash));
            assert_ne!(self.node(edge.parent).parent == FREED, edge.parent != ROOT, "parent freed");
            *children.entry(edge.parent).or_default() += 1;
            live.push(edge.child);
        }
        let mut owner_heap = 0;
        for &id in live.iter().chain([ROOT].iter()) {
            let node = self.node(id);
            assert_eq!(node.children, children.get(&id).copied().unwrap_or(0), "child count of {id}");
            assert!(id == ROOT || node.children > 0 || !node.owners.is_empty(), "orphan node {id}");
            node.owners.check();
            owner_heap += node.owners.heap_bytes();
        }
        assert_eq!(owner_heap, self.owner_heap);
        assert_eq!(live.len(), self.live);
        let slots = self.chunks.iter().map(Vec::len).sum::<usize>();
        assert_eq!(slots, 1 + live.len() + self.free.len(), "leaked slots");
        let owners_of = |id: u32| {
            let mut ids = Vec::new();
            self.node(id).owners.for_each(|o| ids.push(o));
            ids
        };
        live.iter().map(|&id| (id, owners_of(id))).collect()
    }
}
