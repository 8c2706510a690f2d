//! Paged KV cache: fixed-size blocks handed out to sequences as they grow and returned
//! when they finish. A sequence that is away at another model keeps its blocks (its KV
//! never moves), so the cache is indexed by sequence id, not by batch slot. Running out
//! of blocks is a typed error that the scheduler turns into waiting or preemption.

use crate::error::{Result, RuntimeError};
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
#[derive(Clone, Debug, Default)]
pub struct BlockTable {
    pub blocks: Vec<u32>,
    pub len: usize,
}

impl BlockTable {
    /// Physical slot of a position.
    #[inline]
    pub fn slot(&self, pos: usize, block_size: usize) -> usize {
        self.blocks[pos / block_size] as usize * block_size + pos % block_size
    }
}

/// Usage numbers for metrics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvUsage {
    pub used_blocks: usize,
    pub total_blocks: usize,
    pub block_size: usize,
    pub sequences: usize,
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

/// Block bookkeeping (no storage): which blocks are free, which sequence owns which.
#[derive(Debug)]
pub struct BlockManager {
    capacity: KvCapacity,
    free: Vec<u32>,
    seqs: HashMap<SeqId, BlockTable>,
}

impl BlockManager {
    pub fn new(capacity: KvCapacity) -> Self {
        // Pop from the end: hand out low block numbers first (nicer for debugging).
        let free = (0..capacity.num_blocks as u32).rev().collect();
        Self {
            capacity,
            free,
            seqs: HashMap::new(),
        }
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

    /// Blocks still needed to append `new_tokens` to `seq`.
    pub fn blocks_needed(&self, seq: SeqId, new_tokens: usize) -> usize {
        let table = self.seqs.get(&seq);
        let len = table.map_or(0, |t| t.len);
        let have = table.map_or(0, |t| t.blocks.len());
        self.blocks_for(len + new_tokens).saturating_sub(have)
    }

    /// Make room for every (sequence, new tokens) pair, or for none of them.
    pub fn reserve(&mut self, rows: &[(SeqId, usize)]) -> Result<()> {
        let needed: usize = rows
            .iter()
            .map(|&(seq, n)| self.blocks_needed(seq, n))
            .sum();
        if needed > self.free.len() {
            return Err(RuntimeError::OutOfBlocks {
                needed,
                free: self.free.len(),
                total: self.capacity.num_blocks,
            });
        }
        for &(seq, n) in rows {
            let want = self.blocks_needed(seq, n);
            let table = self.seqs.entry(seq).or_default();
            for _ in 0..want {
                // Cannot fail: the total was checked above.
                if let Some(b) = self.free.pop() {
                    table.blocks.push(b);
                }
            }
        }
        Ok(())
    }

    /// Record that `n` positions were written after a successful forward.
    pub fn advance(&mut self, seq: SeqId, n: usize) {
        if let Some(t) = self.seqs.get_mut(&seq) {
            t.len += n;
        }
    }

    /// Return all of a sequence's blocks. Returns whether the sequence existed.
    pub fn free_seq(&mut self, seq: SeqId) -> bool {
        match self.seqs.remove(&seq) {
            Some(t) => {
                self.free.extend(t.blocks.into_iter().rev());
                true
            }
            None => false,
        }
    }

    /// Drop positions beyond `len` (e.g. a token the policy decided to discard), returning
    /// blocks that become empty.
    pub fn truncate(&mut self, seq: SeqId, len: usize) {
        let bs = self.capacity.block_size;
        if let Some(t) = self.seqs.get_mut(&seq) {
            if len < t.len {
                t.len = len;
                let keep = len.div_ceil(bs);
                while t.blocks.len() > keep {
                    if let Some(b) = t.blocks.pop() {
                        self.free.push(b);
                    }
                }
            }
        }
    }

    pub fn usage(&self) -> KvUsage {
        KvUsage {
            used_blocks: self.capacity.num_blocks - self.free.len(),
            total_blocks: self.capacity.num_blocks,
            block_size: self.capacity.block_size,
            sequences: self.seqs.len(),
        }
    }

    pub fn sequences(&self) -> impl Iterator<Item = SeqId> + '_ {
        self.seqs.keys().copied()
    }
}

/// CPU storage of one layer's keys and values: `[slots, kv_heads, head_dim]` each.
#[derive(Debug)]
pub struct LayerKv {
    pub k: Vec<f32>,
    pub v: Vec<f32>,
}

impl LayerKv {
    /// Zeroed buffers are allocated lazily by the OS, so unused capacity costs no memory.
    pub fn new(slots: usize, row: usize) -> Self {
        Self {
            k: vec![0.0; slots * row],
            v: vec![0.0; slots * row],
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
        m.advance(1, 5);
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
        m.advance(1, 3);
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
        m.advance(7, 1);
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
        m.advance(1, 5);
        m.truncate(1, 2);
        assert_eq!(m.seq_len(1), Some(2));
        assert_eq!(m.usage().used_blocks, 1);
    }
}
