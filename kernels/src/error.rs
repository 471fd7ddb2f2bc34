//! The one error type of `fsdp-kernels`.

use fsdp_types::DType;

/// Everything a kernel can reject. Every variant carries the numbers that made it fail, so a
/// caller can print the error as it is.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum KernelError {
    /// Two buffers that must have the same number of elements do not.
    #[error("length mismatch: `{what}` has {actual} elements, expected {expected}")]
    LengthMismatch {
        /// Which argument has the wrong length (e.g. `"grad"`).
        what: &'static str,
        /// The length it must have (elements).
        expected: usize,
        /// The length it has (elements).
        actual: usize,
    },
    /// A span reaches past the end of the buffer it describes.
    #[error(
        "span {index} [{start}, {start}+{len}) is out of bounds for a buffer of {buffer_len} elements"
    )]
    SpanOutOfBounds {
        /// Position of the span in the span list.
        index: usize,
        /// First element of the span.
        start: usize,
        /// Number of elements in the span.
        len: usize,
        /// Number of elements in the buffer.
        buffer_len: usize,
    },
    /// Spans must be listed in increasing order and must not overlap (an overlapping element
    /// would be updated twice).
    #[error("span {index} starts at element {start}, before the end {prev_end} of the span before it (spans must be sorted and disjoint)")]
    SpansOverlap {
        /// Position of the offending span in the span list.
        index: usize,
        /// First element of the offending span.
        start: usize,
        /// One past the last element of the previous span.
        prev_end: usize,
    },
    /// A buffer has a different dtype from the one the operation needs.
    #[error("dtype mismatch: `{what}` is {actual}, expected {expected}")]
    DTypeMismatch {
        /// Which argument has the wrong dtype.
        what: &'static str,
        /// The dtype the operation needs.
        expected: DType,
        /// The dtype the buffer has.
        actual: DType,
    },
    /// An optimizer hyperparameter is outside its valid range.
    #[error("invalid hyperparameter {name} = {value}: must be {requirement}")]
    InvalidHyperparameter {
        /// The hyperparameter's name (`lr`, `beta1`, ...).
        name: &'static str,
        /// The rejected value.
        value: f64,
        /// The valid range, in words.
        requirement: &'static str,
    },
    /// A CUDA driver or NVRTC call of the CUDA kernels (feature `cuda`, module `cuda`) failed;
    /// `message` is the library's own text (`cuGetErrorString`, NVRTC's compile log).
    #[error("CUDA {call} failed: {message}")]
    Device {
        /// The call, with its sizes (e.g. `cuLaunchKernel(fsdp_adamw_tiles)`).
        call: String,
        /// The driver's or NVRTC's error text.
        message: String,
    },
    /// Optimizer steps are counted from 1 (the bias correction of step 0 divides by zero).
    #[error("optimizer step must be >= 1 (1-based), got {step}")]
    ZeroStep {
        /// The rejected step number.
        step: u64,
    },
}

/// Returns [`KernelError::LengthMismatch`] unless `actual == expected`.
pub(crate) fn check_len(
    what: &'static str,
    expected: usize,
    actual: usize,
) -> Result<(), KernelError> {
    if expected == actual {
        Ok(())
    } else {
        Err(KernelError::LengthMismatch {
            what,
            expected,
            actual,
        })
    }
}
