//! Spans: the real (non-padding) element ranges of a flat buffer.

use crate::error::KernelError;
use std::ops::Range;

/// A contiguous range of real elements inside a flat buffer (a flat parameter shard, its
/// gradient, or its optimizer state), with the one property kernels need: whether weight decay
/// applies to it.
///
/// Units: `start` and `len` are in elements, not bytes. Elements that lie in no span are
/// padding: span-taking kernels neither read nor write them.
///
/// Span lists passed to kernels must be sorted by `start` and pairwise disjoint, and every span
/// must lie inside the buffer; [`validate_spans`] checks this. Empty spans (`len == 0`) are
/// allowed and do nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Span {
    /// First element of the span (elements from the start of the buffer).
    pub start: usize,
    /// Number of elements.
    pub len: usize,
    /// Whether decoupled (AdamW) or coupled (SGD) weight decay applies to these elements.
    /// Biases, LayerNorm parameters and embeddings are usually not decayed.
    pub weight_decay: bool,
}

impl Span {
    /// A span of `len` elements starting at element `start`.
    pub const fn new(start: usize, len: usize, weight_decay: bool) -> Span {
        Span {
            start,
            len,
            weight_decay,
        }
    }

    /// The element range `[start, start + len)`. Panics only if `start + len` overflows
    /// `usize`, which [`validate_spans`] rejects first.
    pub fn range(&self) -> Range<usize> {
        self.start..self.start + self.len
    }
}

/// Checks that `spans` describe a buffer of `buffer_len` elements: each span lies inside
/// `[0, buffer_len)`, and the spans are sorted by `start` and do not overlap.
///
/// Errors: [`KernelError::SpanOutOfBounds`] (with the span's index, start, length and the
/// buffer length), [`KernelError::SpansOverlap`].
pub fn validate_spans(spans: &[Span], buffer_len: usize) -> Result<(), KernelError> {
    let mut prev_end = 0usize;
    for (index, s) in spans.iter().enumerate() {
        let end = s.start.checked_add(s.len);
        match end {
            Some(end) if end <= buffer_len => {
                if s.start < prev_end {
                    return Err(KernelError::SpansOverlap {
                        index,
                        start: s.start,
                        prev_end,
                    });
                }
                prev_end = end;
            }
            _ => {
                return Err(KernelError::SpanOutOfBounds {
                    index,
                    start: s.start,
                    len: s.len,
                    buffer_len,
                })
            }
        }
    }
    Ok(())
}
