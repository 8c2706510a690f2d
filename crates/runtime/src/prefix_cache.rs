//! Automatic prefix caching (vLLM's APC, SGLang's radix cache at block granularity): a full
//! KV block is identified by its tokens and everything before them, so a new sequence whose
//! prompt starts like an earlier one reuses those blocks instead of recomputing them. An
//! evaluation sends the same prompt once per variant, a chat client resends its history
//! every turn, and routed variants repeat the small model's answer up to the first routed
//! token that differs: each is a prefix someone already paid for.
//!
//! Only full blocks are indexed and a full block is never written again, so sharing needs
//! no copies. A block is found by a chain hash of (parent's hash, its tokens), and the
//! match is verified against the stored parent and tokens, so a hash collision can never
//! hand out the wrong KV. Blocks nobody holds stay cached until the space is needed; the
//! least recently used goes first.

use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};

/// The chain hash of the empty prefix (parent of a sequence's first block).
pub const ROOT: u64 = 0x9e37_79b9_7f4a_7c15;

/// The root a sequence salted with `salt` chains from (vLLM's `cache_salt`): only sequences
/// with the same salt share cached blocks, so one tenant cannot time another's prompts.
pub fn salted_root(salt: &str) -> u64 {
    let mut h = DefaultHasher::new();
    ROOT.hash(&mut h);
    salt.hash(&mut h);
    h.finish()
}

/// Chain hash of a block holding `tokens` after the prefix hashed as `parent`.
pub fn chain_hash(parent: u64, tokens: &[u32]) -> u64 {
    let mut h = DefaultHasher::new();
    parent.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

#[derive(Debug)]
struct Entry {
    block: u32,
    parent: u64,
    tokens: Box<[u32]>,
}

/// Which physical blocks hold which prefixes, and which of them nobody holds (evictable).
#[derive(Debug, Default)]
pub struct PrefixIndex {
    by_hash: HashMap<u64, Entry>,
    hash_of_block: HashMap<u32, u64>,
    /// Cached blocks with no holder, by last use (oldest first).
    idle: BTreeMap<u64, u32>,
    idle_since: HashMap<u32, u64>,
    clock: u64,
    /// Tokens looked up / found, for the hit rate.
    pub queried_tokens: u64,
    pub hit_tokens: u64,
}

impl PrefixIndex {
    /// The block holding `tokens` after the prefix `parent`, if cached.
    pub fn lookup(&self, parent: u64, tokens: &[u32]) -> Option<(u64, u32)> {
        let h = chain_hash(parent, tokens);
        self.by_hash
            .get(&h)
            .filter(|e| e.parent == parent && *e.tokens == *tokens)
            .map(|e| (h, e.block))
    }

    /// Index a just-filled block. Returns false when the same prefix is already cached in
    /// another block (this one then stays private and is freed normally).
    pub fn insert(&mut self, hash: u64, parent: u64, tokens: &[u32], block: u32) -> bool {
        if self.by_hash.contains_key(&hash) || self.hash_of_block.contains_key(&block) {
            return false;
        }
        self.by_hash.insert(
            hash,
            Entry {
                block,
                parent,
                tokens: tokens.into(),
            },
        );
        self.hash_of_block.insert(block, hash);
        true
    }

    pub fn is_cached(&self, block: u32) -> bool {
        self.hash_of_block.contains_key(&block)
    }

    /// Stop indexing `block` (its content is about to change).
    pub fn remove(&mut self, block: u32) {
        if let Some(h) = self.hash_of_block.remove(&block) {
            self.by_hash.remove(&h);
        }
        self.take_idle(block);
    }

    /// A cached block lost its last holder: keep it, evictable.
    pub fn park(&mut self, block: u32) {
        self.clock += 1;
        self.idle.insert(self.clock, block);
        self.idle_since.insert(block, self.clock);
    }

    /// A parked block got a holder again. Returns whether it was parked.
    pub fn take_idle(&mut self, block: u32) -> bool {
        match self.idle_since.remove(&block) {
            Some(t) => {
                self.idle.remove(&t);
                true
            }
            None => false,
        }
    }

    /// Reclaim the least recently used parked block for new content.
    pub fn evict(&mut self) -> Option<u32> {
        let (&t, &block) = self.idle.iter().next()?;
        self.idle.remove(&t);
        self.idle_since.remove(&block);
        if let Some(h) = self.hash_of_block.remove(&block) {
            self.by_hash.remove(&h);
        }
        Some(block)
    }

    /// Blocks indexed, parked or held.
    pub fn cached_blocks(&self) -> usize {
        self.hash_of_block.len()
    }

    /// Forget every cached prefix: returns the parked blocks (free now); blocks that
    /// sequences hold stay theirs and are freed normally when they let go.
    pub fn clear(&mut self) -> Vec<u32> {
        let parked = self.idle.values().copied().collect();
        self.by_hash.clear();
        self.hash_of_block.clear();
        self.idle.clear();
        self.idle_since.clear();
        parked
    }

    /// Parked blocks: cached, held by nobody, reusable at once.
    pub fn idle_blocks(&self) -> usize {
        self.idle.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookup_verifies_parent_and_tokens() {
        let mut p = PrefixIndex::default();
        let h = chain_hash(ROOT, &[1, 2]);
        assert!(p.insert(h, ROOT, &[1, 2], 7));
        assert_eq!(p.lookup(ROOT, &[1, 2]), Some((h, 7)));
        assert_eq!(p.lookup(ROOT, &[1, 3]), None);
        assert_eq!(
            p.lookup(h, &[1, 2]),
            None,
            "same tokens after another prefix"
        );
        assert!(!p.insert(h, ROOT, &[1, 2], 8), "one block per prefix");
    }

    #[test]
    fn eviction_takes_the_least_recently_parked() {
        let mut p = PrefixIndex::default();
        for b in 0..3u32 {
            let h = chain_hash(ROOT, &[b]);
            p.insert(h, ROOT, &[b], b);
            p.park(b);
        }
        assert!(p.take_idle(0), "block 0 is held again");
        p.park(0);
        assert_eq!(p.evict(), Some(1));
        assert_eq!(p.lookup(ROOT, &[1]), None, "evicted content is forgotten");
        assert_eq!(p.evict(), Some(2));
        assert_eq!(p.evict(), Some(0));
        assert_eq!(p.evict(), None);
    }
}
