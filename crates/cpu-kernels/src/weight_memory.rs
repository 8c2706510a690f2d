//! Where our kernels' weights live: on transparent huge pages where the system has them.
//!
//! A decode step streams every weight once from DRAM. With 4 KiB pages that stream crosses a
//! page every 4 KiB (a TLB miss and a page walk each time, on top of the DRAM reads); with
//! 2 MiB pages it crosses one every 2 MiB. On the 2-core Zen 4 VMs this project is measured
//! on, a plain two-thread read of 1 GiB ran 28 GB/s on 4 KiB pages and 34.5 GB/s on 2 MiB
//! ones (docs/benchmarks.md, session 54). Heap allocations do not get huge pages where the
//! system's policy is `madvise` (the common default), so weights of 2 MiB and more get their
//! own mapping, aligned to 2 MiB, with `MADV_HUGEPAGE` on its whole 2 MiB chunks (a partial
//! last chunk stays on small pages: a huge page there would be resident memory beyond the
//! weight). Where the system has no huge pages the advice changes nothing. Weights our
//! kernels read in the file's layout are copied out of candle's tensors for this (the model
//! then drops candle's); with [`WeightMemory::Heap`] they stay shared with candle.

use candle_core::quantized::QTensor;
use std::borrow::Cow;
use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;

/// The huge page size this module aligns to (x86-64's and most arm64 kernels' PMD size).
const HUGE_PAGE: usize = 2 << 20;

/// Where a weight's memory comes from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WeightMemory {
    /// Huge pages for weights of 2 MiB and more (the heap where mapping fails).
    #[default]
    HugePages,
    /// The process heap, and weights kept in the file's layout stay in candle's tensor,
    /// shared rather than copied (a tied embedding and output matrix; A/B measurements).
    Heap,
}

/// A weight kept in the file's layout: candle's tensor, shared, or our copy.
#[derive(Clone)]
pub(crate) enum WeightBytes {
    Candle(Arc<QTensor>),
    Own(Arc<WeightVec<u8>>),
}

impl WeightBytes {
    /// `t`'s bytes in `memory`: shared with candle on the heap, else copied.
    pub(crate) fn new(t: &Arc<QTensor>, memory: WeightMemory) -> Option<Self> {
        Some(match memory {
            WeightMemory::Heap => Self::Candle(t.clone()),
            WeightMemory::HugePages => {
                Self::Own(Arc::new(WeightVec::from_slice(&t.data().ok()?, memory)))
            }
        })
    }

    /// Owned bytes (a stacked or regrouped weight) in `memory`.
    pub(crate) fn own(bytes: WeightVec<u8>) -> Self {
        Self::Own(Arc::new(bytes))
    }

    /// `parts` one after the other (rows of one width stacked), owned, in `memory`.
    pub(crate) fn concat(parts: &[&WeightBytes], memory: WeightMemory) -> Option<Self> {
        let bytes: Vec<_> = parts
            .iter()
            .map(|p| p.bytes().ok())
            .collect::<Option<_>>()?;
        let bytes: Vec<&[u8]> = bytes.iter().map(|b| &b[..]).collect();
        Some(Self::own(WeightVec::concat(&bytes, memory)))
    }

    pub(crate) fn bytes(&self) -> candle_core::Result<Cow<'_, [u8]>> {
        match self {
            Self::Candle(t) => t.data(),
            Self::Own(b) => Ok(Cow::Borrowed(b)),
        }
    }

    #[cfg(test)]
    pub(crate) fn is_mapped(&self) -> bool {
        matches!(self, Self::Own(b) if b.is_mapped())
    }
}

/// Element types whose every value is valid as all-zero bytes and that need no drop: a
/// fresh anonymous mapping holds zeros.
///
/// # Safety
/// All-zero bytes must be a valid `Self`, and `Self` must not implement `Drop`.
pub(crate) unsafe trait ZeroValid: Clone {}

// SAFETY: a byte is any bit pattern.
unsafe impl ZeroValid for u8 {}

/// A fixed-length array of `T` for the lifetime of a weight: a mapping on huge pages or a
/// heap vector.
pub(crate) struct WeightVec<T: ZeroValid> {
    mem: Mem<T>,
}

enum Mem<T> {
    Mapped {
        map: memmap2::MmapMut,
        /// Bytes into `map` where the elements start (the first 2 MiB boundary).
        offset: usize,
        len: usize,
        _t: PhantomData<T>,
    },
    Heap(Vec<T>),
}

impl<T: ZeroValid> WeightVec<T> {
    /// `len` zeroed elements in `memory`.
    pub(crate) fn zeroed(len: usize, memory: WeightMemory) -> Self {
        let bytes = len * std::mem::size_of::<T>();
        if memory == WeightMemory::HugePages && bytes >= HUGE_PAGE {
            if let Ok((map, offset)) = huge_mapping(bytes) {
                return Self {
                    mem: Mem::Mapped {
                        map,
                        offset,
                        len,
                        _t: PhantomData,
                    },
                };
            }
        }
        // SAFETY: all-zero bytes are a valid `T` (`ZeroValid`).
        let zero: T = unsafe { std::mem::zeroed() };
        Self {
            mem: Mem::Heap(vec![zero; len]),
        }
    }

    /// A copy of `items` in `memory`.
    pub(crate) fn from_slice(items: &[T], memory: WeightMemory) -> Self {
        Self::concat(&[items], memory)
    }

    /// The concatenation of `parts` in `memory`.
    pub(crate) fn concat(parts: &[&[T]], memory: WeightMemory) -> Self {
        let mut v = Self::zeroed(parts.iter().map(|p| p.len()).sum(), memory);
        let mut at = 0;
        for p in parts {
            v[at..at + p.len()].clone_from_slice(p);
            at += p.len();
        }
        v
    }

    /// Whether the elements are in their own huge-page mapping.
    #[cfg(test)]
    pub(crate) fn is_mapped(&self) -> bool {
        matches!(self.mem, Mem::Mapped { .. })
    }
}

/// An anonymous mapping of `bytes` plus one huge page of slack, the offset of its first
/// 2 MiB boundary, and its whole 2 MiB chunks from there advised for huge pages. The slack
/// before the boundary and after the last byte is never touched, so never resident.
fn huge_mapping(bytes: usize) -> std::io::Result<(memmap2::MmapMut, usize)> {
    let map = memmap2::MmapOptions::new()
        .len(bytes + HUGE_PAGE)
        .map_anon()?;
    let offset = map.as_ptr().align_offset(HUGE_PAGE);
    #[cfg(target_os = "linux")]
    {
        // A kernel without transparent huge pages refuses the advice; the mapping is still
        // good memory.
        let whole = bytes / HUGE_PAGE * HUGE_PAGE;
        let _ = map.advise_range(memmap2::Advice::HugePage, offset, whole);
    }
    Ok((map, offset))
}

impl<T: ZeroValid> Deref for WeightVec<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        match &self.mem {
            // SAFETY: `offset + len * size_of::<T>()` bytes lie inside the mapping (it has a
            // huge page of slack), the offset is 2 MiB-aligned (so aligned for `T`), and the
            // mapping started zeroed (valid `T`s, `ZeroValid`).
            Mem::Mapped {
                map, offset, len, ..
            } => unsafe { std::slice::from_raw_parts(map.as_ptr().add(*offset) as *const T, *len) },
            Mem::Heap(v) => v,
        }
    }
}

impl<T: ZeroValid> DerefMut for WeightVec<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match &mut self.mem {
            // SAFETY: as in `deref`, and `&mut self` makes this the only reference.
            Mem::Mapped {
                map, offset, len, ..
            } => unsafe {
                std::slice::from_raw_parts_mut(map.as_mut_ptr().add(*offset) as *mut T, *len)
            },
            Mem::Heap(v) => v,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_weights_stay_on_the_heap_and_large_ones_are_mapped() {
        let small = WeightVec::<u8>::zeroed(HUGE_PAGE - 1, WeightMemory::HugePages);
        assert!(!small.is_mapped());
        let heap = WeightVec::<u8>::zeroed(3 * HUGE_PAGE, WeightMemory::Heap);
        assert!(!heap.is_mapped());
        let big = WeightVec::<u8>::zeroed(3 * HUGE_PAGE + 5, WeightMemory::HugePages);
        assert!(big.is_mapped());
        assert_eq!(big.len(), 3 * HUGE_PAGE + 5);
        assert!(big.iter().all(|&b| b == 0));
        assert_eq!(big.as_ptr() as usize % HUGE_PAGE, 0);
    }

    #[test]
    fn copies_and_concatenations_keep_every_element() {
        let a: Vec<u8> = (0..HUGE_PAGE + 77).map(|i| (i * 7 % 251) as u8).collect();
        let b: Vec<u8> = (0..1000).map(|i| (i % 13) as u8).collect();
        for memory in [WeightMemory::HugePages, WeightMemory::Heap] {
            assert_eq!(&*WeightVec::from_slice(&a, memory), &a[..]);
            let joined = WeightVec::concat(&[&a, &b, &a], memory);
            assert_eq!(&*joined, &[&a[..], &b[..], &a[..]].concat()[..]);
        }
    }

    /// The kernel sees the advice on exactly the whole 2 MiB chunks: `/proc/self/smaps`
    /// marks advised areas `hg` (whether huge pages are then granted is the system's policy,
    /// so that is not asserted).
    #[cfg(target_os = "linux")]
    #[test]
    fn whole_chunks_are_advised_for_huge_pages() {
        if !std::path::Path::new("/sys/kernel/mm/transparent_hugepage/enabled").exists() {
            return; // a kernel without transparent huge pages: nothing to advise
        }
        let v = WeightVec::<u8>::zeroed(2 * HUGE_PAGE + 4096, WeightMemory::HugePages);
        let start = v.as_ptr() as usize;
        let Ok(smaps) = std::fs::read_to_string("/proc/self/smaps") else {
            return;
        };
        // (start, end, flags) of each area.
        let mut areas = Vec::new();
        let mut current: Option<(usize, usize)> = None;
        for line in smaps.lines() {
            if let Some(flags) = line.strip_prefix("VmFlags:") {
                if let Some((s, e)) = current.take() {
                    areas.push((s, e, flags.split_whitespace().any(|f| f == "hg")));
                }
            } else if let Some((range, _)) = line.split_once(' ') {
                if let Some((s, e)) = range.split_once('-') {
                    if let (Ok(s), Ok(e)) =
                        (usize::from_str_radix(s, 16), usize::from_str_radix(e, 16))
                    {
                        current = Some((s, e));
                    }
                }
            }
        }
        let advised = |addr: usize| {
            areas
                .iter()
                .find(|(s, e, _)| (*s..*e).contains(&addr))
                .map(|a| a.2)
        };
        assert_eq!(advised(start), Some(true));
        assert_eq!(advised(start + 2 * HUGE_PAGE - 1), Some(true));
        assert_eq!(advised(start + 2 * HUGE_PAGE), Some(false));
    }
}
