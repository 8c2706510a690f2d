//! Paged KV cache: fixed-size blocks handed out to sequences as they grow and returned
//! when they finish. A sequence that is away at another model keeps its blocks (its KV
//! never moves), so the cache is indexed by sequence id, not by batch slot. Running out
//! of blocks is a typed error that the scheduler turns into waiting or preemption.

use crate::error::{Result, RuntimeError};
use crate::prefix_cache::{chain_hash, salted_root, PrefixIndex, ROOT};
use std::collections::HashMap;

pub type SeqId = u64;

/// Capacity of a cache, in blocks of `block_size` tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvCapacity {
    pub block_size: usize,
    pub num_blocks: usize,
}

impl KvCapacity {
    pub const DEFAULT_BLOCK_SIZE: usize = 16;

    /// Enough blocks for `tokens` tokens.
    pub fn tokens(tokens: usize) -> Self {
        let bs = Self::DEFAULT_BLOCK_SIZE;
        Self {
            block_size: bs,
            num_blocks: tokens.div_ceil(bs).max(1),
        }
    }

    /// As many blocks as fit in `bytes`, given the bytes one token needs.
    pub fn memory(bytes: usize, bytes_per_token: usize) -> Self {
        Self::tokens(bytes / bytes_per_token.max(1))
    }

    pub fn total_tokens(&self) -> usize {
        self.block_size * self.num_blocks
    }
}

/// Where a sequence's tokens live: its blocks in order and how many positions are filled.
/// With prefix caching it also keeps the tokens and the chain hash of each full block, so
/// blocks can be indexed as they fill.
#[derive(Clone, Debug)]
pub struct BlockTable {
    pub blocks: Vec<u32>,
    pub len: usize,
    tokens: Vec<u32>,
    hashes: Vec<u64>,
    /// The parent hash of the first block: [`ROOT`], or a salted root.
    root: u64,
}

impl Default for BlockTable {
    fn default() -> Self {
        Self::rooted(ROOT)
    }
}

impl BlockTable {
    fn rooted(root: u64) -> Self {
        Self {
            blocks: Vec::new(),
            len: 0,
            tokens: Vec::new(),
            hashes: Vec::new(),
            root,
        }
    }

    /// Physical slot of a position.
    #[inline]
    pub fn slot(&self, pos: usize, block_size: usize) -> usize {
        self.blocks[pos / block_size] as usize * block_size + pos % block_size
    }
}

/// Usage numbers for metrics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvUsage {
    /// Blocks held by sequences.
    pub used_blocks: usize,
    pub total_blocks: usize,
    pub block_size: usize,
    pub sequences: usize,
    /// Blocks that nobody holds but that keep a cached prefix (reusable, evictable).
    pub cached_blocks: usize,
}

impl KvUsage {
    pub fn fraction(&self) -> f64 {
        if self.total_blocks == 0 {
            0.0
        } else {
            self.used_blocks as f64 / self.total_blocks as f64
        }
    }
}

/// Block bookkeeping (no storage): which blocks are free, which sequence holds which, and,
/// with prefix caching on, which full blocks hold a known prefix (`prefix_cache.rs`).
#[derive(Debug)]
pub struct BlockManager {
    capacity: KvCapacity,
    free: Vec<u32>,
    seqs: HashMap<SeqId, BlockTable>,
    /// Holders per block (several sequences share a cached prefix block).
    refs: Vec<u32>,
    prefix: Option<PrefixIndex>,
    /// Salted roots of sequences not created yet ([`BlockManager::salt`]).
    roots: HashMap<SeqId, u64>,
}

impl BlockManager {
    pub fn new(capacity: KvCapacity) -> Self {
        // Pop from the end: hand out low block numbers first (nicer for debugging).
        let free = (0..capacity.num_blocks as u32).rev().collect();
        Self {
            capacity,
            free,
            seqs: HashMap::new(),
            refs: vec![0; capacity.num_blocks],
            prefix: None,
            roots: HashMap::new(),
        }
    }

    /// A manager that keeps and reuses full blocks of earlier sequences.
    pub fn with_prefix_cache(capacity: KvCapacity) -> Self {
        Self {
            prefix: Some(PrefixIndex::default()),
            ..Self::new(capacity)
        }
    }

    pub fn prefix_caching(&self) -> bool {
        self.prefix.is_some()
    }

    pub fn capacity(&self) -> KvCapacity {
        self.capacity
    }

    pub fn seq_len(&self, seq: SeqId) -> Option<usize> {
        self.seqs.get(&seq).map(|t| t.len)
    }

    pub fn table(&self, seq: SeqId) -> Option<&BlockTable> {
        self.seqs.get(&seq)
    }

    fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.capacity.block_size)
    }

    /// Blocks that can be handed out now: free ones and cached ones nobody holds.
    fn available(&self) -> usize {
        self.free.len() + self.prefix.as_ref().map_or(0, PrefixIndex::idle_blocks)
    }

    fn take_block(&mut self) -> Option<u32> {
        let b = self
            .free
            .pop()
            .or_else(|| self.prefix.as_mut().and_then(PrefixIndex::evict))?;
        self.refs[b as usize] = 1;
        Some(b)
    }

    /// Drop one holder of `b`; with none left it is parked (cached) or freed.
    fn release_block(&mut self, b: u32) {
        let r = &mut self.refs[b as usize];
        *r = r.saturating_sub(1);
        if *r > 0 {
            return;
        }
        match self.prefix.as_mut() {
            Some(p) if p.is_cached(b) => p.park(b),
            _ => self.free.push(b),
        }
    }

    /// Blocks still needed to append `new_tokens` to `seq`.
    pub fn blocks_needed(&self, seq: SeqId, new_tokens: usize) -> usize {
        let table = self.seqs.get(&seq);
        let len = table.map_or(0, |t| t.len);
        let have = table.map_or(0, |t| t.blocks.len());
        self.blocks_for(len + new_tokens).saturating_sub(have)
    }

    /// Salt a sequence not created yet (vLLM's `cache_salt`): it reuses and leaves cached
    /// only blocks of sequences with the same salt. A sequence that exists keeps its root.
    pub fn salt(&mut self, seq: SeqId, salt: &str) {
        if self.prefix.is_some() && !self.seqs.contains_key(&seq) {
            self.roots.insert(seq, salted_root(salt));
        }
    }

    /// The table a sequence starts with: rooted at its salt, if it has one.
    fn new_table(&mut self, seq: SeqId) -> BlockTable {
        BlockTable::rooted(self.roots.remove(&seq).unwrap_or(ROOT))
    }

    /// For a sequence not seen yet whose tokens will be `tokens`: take the cached blocks
    /// holding its longest cached prefix (whole blocks, and never all of `tokens`: the last
    /// one must be computed for its logits). Returns the positions now cached, 0 without a
    /// hit or without prefix caching; a sequence that exists keeps what it has.
    pub fn attach_prefix(&mut self, seq: SeqId, tokens: &[u32]) -> usize {
        if let Some(t) = self.seqs.get(&seq) {
            return t.len;
        }
        let bs = self.capacity.block_size;
        let root = self.roots.get(&seq).copied().unwrap_or(ROOT);
        let Some(prefix) = self.prefix.as_mut() else {
            return 0;
        };
        prefix.queried_tokens += tokens.len() as u64;
        let mut table = BlockTable::rooted(root);
        let mut parent = root;
        for chunk in tokens[..tokens.len().saturating_sub(1)].chunks_exact(bs) {
            let Some((h, b)) = prefix.lookup(parent, chunk) else {
                break;
            };
            prefix.take_idle(b);
            self.refs[b as usize] += 1;
            table.blocks.push(b);
            table.hashes.push(h);
            table.tokens.extend_from_slice(chunk);
            parent = h;
        }
        table.len = table.tokens.len();
        prefix.hit_tokens += table.len as u64;
        let len = table.len;
        if len > 0 {
            self.roots.remove(&seq);
            self.seqs.insert(seq, table);
        }
        len
    }

    /// Forget every cached prefix (SGLang's `/flush_cache`, vLLM's `/reset_prefix_cache`):
    /// no later sequence reuses what was computed before. Returns the cached blocks dropped.
    pub fn flush_prefix_cache(&mut self) -> usize {
        let Some(prefix) = self.prefix.as_mut() else {
            return 0;
        };
        let indexed = prefix.cached_blocks();
        let parked = prefix.clear();
        self.free.extend(parked);
        indexed
    }

    /// Make room for every (sequence, new tokens) pair, or for none of them.
    pub fn reserve(&mut self, rows: &[(SeqId, usize)]) -> Result<()> {
        let needed: usize = rows
            .iter()
            .map(|&(seq, n)| self.blocks_needed(seq, n))
            .sum();
        if needed > self.available() {
            return Err(RuntimeError::OutOfBlocks {
                needed,
                free: self.available(),
                total: self.capacity.num_blocks,
            });
        }
        for &(seq, n) in rows {
            let want = self.blocks_needed(seq, n);
            let mut got = Vec::with_capacity(want);
            for _ in 0..want {
                // Cannot fail: the total was checked above.
                if let Some(b) = self.take_block() {
                    got.push(b);
                }
            }
            if !self.seqs.contains_key(&seq) {
                let table = self.new_table(seq);
                self.seqs.insert(seq, table);
            }
            if let Some(t) = self.seqs.get_mut(&seq) {
                t.blocks.extend(got);
            }
        }
        Ok(())
    }

    /// Record that `tokens` were written at the end of `seq` after a successful forward;
    /// with prefix caching, index the blocks they filled.
    pub fn advance(&mut self, seq: SeqId, tokens: &[u32]) {
        let bs = self.capacity.block_size;
        let Some(t) = self.seqs.get_mut(&seq) else {
            return;
        };
        t.len += tokens.len();
        let Some(prefix) = self.prefix.as_mut() else {
            return;
        };
        t.tokens.extend_from_slice(tokens);
        while t.hashes.len() < t.len / bs {
            let i = t.hashes.len();
            let parent = t.hashes.last().copied().unwrap_or(t.root);
            let chunk = &t.tokens[i * bs..(i + 1) * bs];
            let h = chain_hash(parent, chunk);
            prefix.insert(h, parent, chunk, t.blocks[i]);
            t.hashes.push(h);
        }
    }

    /// Give up all of a sequence's blocks (cached ones stay reusable). Returns whether the
    /// sequence existed.
    pub fn free_seq(&mut self, seq: SeqId) -> bool {
        self.roots.remove(&seq);
        match self.seqs.remove(&seq) {
            Some(t) => {
                for b in t.blocks.into_iter().rev() {
                    self.release_block(b);
                }
                true
            }
            None => false,
        }
    }

    /// Drop positions beyond `len` (e.g. a token the policy decided to discard), returning
    /// blocks that become empty. A cached block that would be written again is taken out of
    /// the index, or, when other sequences share it, given up too: the sequence then keeps
    /// fewer positions than asked. Returns the positions kept.
    pub fn truncate(&mut self, seq: SeqId, len: usize) -> usize {
        let bs = self.capacity.block_size;
        let Some(t) = self.seqs.get_mut(&seq) else {
            return 0;
        };
        if len >= t.len {
            return t.len;
        }
        let mut len = len;
        if let Some(prefix) = self.prefix.as_mut() {
            if !len.is_multiple_of(bs) {
                let b = t.blocks[len / bs];
                if prefix.is_cached(b) {
                    if self.refs[b as usize] > 1 {
                        len -= len % bs;
                    } else {
                        prefix.remove(b);
                    }
                }
            }
            t.tokens.truncate(len);
            t.hashes.truncate(len / bs);
        }
        t.len = len;
        let keep = len.div_ceil(bs);
        let dropped: Vec<u32> = t.blocks.drain(keep.min(t.blocks.len())..).collect();
        for b in dropped.into_iter().rev() {
            self.release_block(b);
        }
        len
    }

    pub fn usage(&self) -> KvUsage {
        let cached = self.prefix.as_ref().map_or(0, PrefixIndex::idle_blocks);
        KvUsage {
            used_blocks: self.capacity.num_blocks - self.free.len() - cached,
            total_blocks: self.capacity.num_blocks,
            block_size: self.capacity.block_size,
            sequences: self.seqs.len(),
            cached_blocks: cached,
        }
    }

    /// Prompt tokens looked up in the prefix cache and found there, since the start.
    pub fn prefix_hits(&self) -> (u64, u64) {
        self.prefix
            .as_ref()
            .map_or((0, 0), |p| (p.queried_tokens, p.hit_tokens))
    }

    pub fn sequences(&self) -> impl Iterator<Item = SeqId> + '_ {
        self.seqs.keys().copied()
    }
}

/// CPU storage of one layer's keys and values: `[slots, kv_heads, head_dim]` each.
#[derive(Debug)]
pub struct LayerKv {
    /// f16 values as bits (llama.cpp's default cache type): half the bytes a long context's
    /// decode step streams, and the values attention rounds to anyway.
    pub k: Vec<u16>,
    pub v: Vec<u16>,
}

impl LayerKv {
    /// Zeroed buffers are allocated lazily by the OS, so unused capacity costs no memory.
    pub fn new(slots: usize, row: usize) -> Self {
        Self {
            k: vec![0; slots * row],
            v: vec![0; slots * row],
        }
    }
}

/// A model's KV storage: host vectors (the CPU path, `attention.rs`) or device tensors
/// (the GPU path, `attention_device.rs`), one entry per layer.
#[derive(Debug)]
pub enum KvStore {
    Host(Vec<LayerKv>),
    Device(Vec<crate::attention_device::TensorKv>),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserve_is_all_or_nothing_and_free_returns_blocks() {
        let mut m = BlockManager::new(KvCapacity {
            block_size: 4,
            num_blocks: 3,
        });
        m.reserve(&[(1, 5)]).unwrap();
        assert_eq!(m.usage().used_blocks, 2);
        m.advance(1, &[0; 5]);
        let err = m.reserve(&[(2, 4), (3, 1)]).unwrap_err();
        assert!(matches!(
            err,
            RuntimeError::OutOfBlocks {
                needed: 2,
                free: 1,
                ..
            }
        ));
        assert_eq!(m.usage().used_blocks, 2, "failed reserve must not allocate");
        m.reserve(&[(1, 3)]).unwrap();
        assert_eq!(m.usage().used_blocks, 2, "fits in the partly filled block");
        m.advance(1, &[0; 3]);
        m.reserve(&[(1, 1)]).unwrap();
        assert_eq!(m.usage().used_blocks, 3);
        assert!(m.free_seq(1));
        assert_eq!(m.usage().used_blocks, 0);
        assert!(!m.free_seq(1));
    }

    #[test]
    fn slots_follow_block_table() {
        let mut m = BlockManager::new(KvCapacity {
            block_size: 2,
            num_blocks: 4,
        });
        m.reserve(&[(7, 1)]).unwrap();
        m.reserve(&[(8, 2)]).unwrap();
        m.advance(7, &[0]);
        m.reserve(&[(7, 2)]).unwrap();
        let t = m.table(7).unwrap();
        assert_eq!(t.blocks, vec![0, 2]);
        assert_eq!(t.slot(0, 2), 0);
        assert_eq!(t.slot(2, 2), 4);
        assert_eq!(t.slot(3, 2), 5);
    }

    #[test]
    fn truncate_returns_empty_blocks() {
        let mut m = BlockManager::new(KvCapacity {
            block_size: 2,
            num_blocks: 4,
        });
        m.reserve(&[(1, 5)]).unwrap();
        m.advance(1, &[0; 5]);
        m.truncate(1, 2);
        assert_eq!(m.seq_len(1), Some(2));
        assert_eq!(m.usage().used_blocks, 1);
    }

    fn prefix_manager(blocks: usize) -> BlockManager {
        BlockManager::with_prefix_cache(KvCapacity {
            block_size: 2,
            num_blocks: blocks,
        })
    }

    /// Run `tokens` through `seq` as one step would: reuse what is cached, reserve, advance.
    fn write(m: &mut BlockManager, seq: SeqId, tokens: &[u32]) -> usize {
        let hit = m.attach_prefix(seq, tokens);
        let have = m.seq_len(seq).unwrap_or(0);
        m.reserve(&[(seq, tokens.len() - have)]).unwrap();
        m.advance(seq, &tokens[have..]);
        hit
    }

    #[test]
    fn a_finished_prompt_is_reused_block_by_block() {
        let mut m = prefix_manager(8);
        assert_eq!(write(&mut m, 1, &[1, 2, 3, 4, 5]), 0, "nothing cached yet");
        let first = m.table(1).unwrap().blocks.clone();
        m.free_seq(1);
        assert_eq!(m.usage().used_blocks, 0);
        assert_eq!(
            m.usage().cached_blocks,
            2,
            "the two full blocks stay, the partial one is freed"
        );
        // Same first block, different second: only the first is reused.
        assert_eq!(write(&mut m, 2, &[1, 2, 3, 9, 5]), 2);
        assert_eq!(m.table(2).unwrap().blocks[0], first[0]);
        assert_ne!(m.table(2).unwrap().blocks[1], first[1]);
        // The whole prompt cached: the last token is still computed (its logits are needed).
        assert_eq!(write(&mut m, 3, &[1, 2, 3, 4]), 2);
        assert_eq!(m.seq_len(3), Some(4));
        assert_eq!(write(&mut m, 4, &[1, 2, 3, 4, 7]), 4);
        // Sequence 3 recomputed [3, 4] into a block of its own, which stays private: the
        // index keeps the first copy.
        assert_eq!(m.table(4).unwrap().blocks[..2], first[..2]);
        assert_eq!(m.prefix_hits(), (5 + 5 + 4 + 5, 2 + 2 + 4));
    }

    #[test]
    fn salted_sequences_share_blocks_only_with_their_salt() {
        let mut m = prefix_manager(24);
        // Salted, created by `reserve` (no attach first): its blocks are cached under the salt.
        m.salt(1, "tenant-a");
        m.reserve(&[(1, 5)]).unwrap();
        m.advance(1, &[1, 2, 3, 4, 5]);
        m.free_seq(1);
        let tokens = [1, 2, 3, 4, 5];
        assert_eq!(write(&mut m, 2, &tokens), 0, "unsalted: nothing to share");
        m.salt(3, "tenant-b");
        assert_eq!(
            write(&mut m, 3, &tokens),
            0,
            "another salt: nothing to share"
        );
        m.salt(4, "tenant-a");
        assert_eq!(
            write(&mut m, 4, &tokens),
            4,
            "the same salt: both full blocks"
        );
        // The unsalted sequence cached its own blocks, which salted ones never see.
        assert_eq!(write(&mut m, 5, &tokens), 4);
        m.salt(6, "tenant-c");
        assert_eq!(write(&mut m, 6, &tokens), 0);
        for s in 2..=6 {
            m.free_seq(s);
        }
        // A salt set but never used is dropped with its sequence.
        m.salt(7, "tenant-a");
        m.free_seq(7);
        assert!(m.roots.is_empty());
        assert_eq!(m.usage().used_blocks, 0);
    }

    #[test]
    fn a_flush_forgets_every_prefix_and_leaks_no_block() {
        let mut m = prefix_manager(6);
        write(&mut m, 1, &[1, 2, 3, 4, 5]);
        m.free_seq(1);
        write(&mut m, 2, &[1, 2, 3, 4, 6]);
        assert_eq!(
            m.flush_prefix_cache(),
            2,
            "the two full blocks were indexed"
        );
        assert_eq!(m.usage().cached_blocks, 0);
        assert_eq!(m.usage().used_blocks, 3, "sequence 2 keeps what it holds");
        assert_eq!(write(&mut m, 3, &[1, 2, 3, 4, 5]), 0, "nothing is reused");
        m.free_seq(2);
        m.free_seq(3);
        // Sequence 2's blocks were forgotten (freed); sequence 3's full ones are cached anew.
        assert_eq!((m.usage().used_blocks, m.usage().cached_blocks), (0, 2));
        assert_eq!(m.available(), 6);
        assert_eq!(write(&mut m, 4, &[1, 2, 3, 4, 5]), 4);
    }

    #[test]
    fn shared_blocks_are_returned_by_their_last_holder() {
        let mut m = prefix_manager(4);
        write(&mut m, 1, &[1, 2, 3, 4, 5]);
        write(&mut m, 2, &[1, 2, 3, 4, 6]);
        assert_eq!(
            m.usage().used_blocks,
            4,
            "two shared full blocks and two partial ones"
        );
        m.free_seq(1);
        assert_eq!(
            m.usage().used_blocks,
            3,
            "sequence 2 still holds the shared blocks"
        );
        m.free_seq(2);
        assert_eq!(m.usage().used_blocks, 0);
        assert_eq!(m.usage().cached_blocks, 2);
    }

    #[test]
    fn cached_blocks_are_evicted_oldest_first_when_space_is_needed() {
        let mut m = prefix_manager(3);
        write(&mut m, 1, &[1, 2]);
        m.free_seq(1);
        write(&mut m, 2, &[3, 4]);
        m.free_seq(2);
        assert_eq!(m.usage().cached_blocks, 2);
        // Two new blocks are needed and one is free: the oldest cached one goes.
        write(&mut m, 3, &[5, 6, 7]);
        assert_eq!(m.usage().cached_blocks, 1);
        assert_eq!(m.attach_prefix(4, &[1, 2, 0]), 0, "evicted");
        assert_eq!(m.attach_prefix(5, &[3, 4, 0]), 2, "kept");
        let err = m.reserve(&[(6, 6)]).unwrap_err();
        assert!(matches!(err, RuntimeError::OutOfBlocks { free: 0, .. }));
    }

    #[test]
    fn truncating_into_a_cached_block_never_changes_what_others_read() {
        let mut m = prefix_manager(6);
        write(&mut m, 1, &[1, 2, 3, 4]);
        write(&mut m, 2, &[1, 2, 3, 4, 5]);
        // Block [3, 4] is shared by both: sequence 2 cannot keep 3 positions inside it.
        assert_eq!(m.truncate(2, 3), 2);
        assert_eq!(m.seq_len(2), Some(2));
        write(&mut m, 2, &[1, 2, 8, 9]);
        assert_eq!(m.attach_prefix(3, &[1, 2, 3, 4, 0]), 4, "[3, 4] is intact");
        // Held by one sequence only: the block leaves the index and stays with its holder.
        m.free_seq(3);
        m.free_seq(2);
        assert_eq!(m.truncate(1, 3), 3);
        assert_eq!(m.attach_prefix(4, &[1, 2, 3, 4, 0]), 2);
    }

    #[test]
    fn without_prefix_caching_nothing_is_kept() {
        let mut m = BlockManager::new(KvCapacity {
            block_size: 2,
            num_blocks: 4,
        });
        write(&mut m, 1, &[1, 2, 3]);
        m.free_seq(1);
        assert_eq!(m.attach_prefix(2, &[1, 2, 3]), 0);
        assert_eq!(m.usage().cached_blocks, 0);
        assert_eq!(m.usage().used_blocks, 0);
    }
}
