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
    /// A tensor kernel (module `tensor`) got a tensor whose elements are not contiguous in
    /// row-major order (a transposed or strided view). Shape and stride are in elements.
    #[error("`{what}` is not contiguous: shape {shape:?}, stride {stride:?} (elements); call `.contiguous()` first")]
    NotContiguous {
        /// Which argument (e.g. `"grad"`).
        what: &'static str,
        /// The tensor's shape.
        shape: Vec<usize>,
        /// The tensor's strides (elements).
        stride: Vec<usize>,
    },
    /// A tensor kernel got a tensor whose dtype it does not support for that argument (e.g. an
    /// integer tensor, or an f64 destination of a cast).
    #[error("`{what}` has dtype {dtype}; supported: {supported}")]
    UnsupportedDType {
        /// Which argument.
        what: &'static str,
        /// The tensor's dtype, as candle names it (`u8`, `f64`, ...).
        dtype: String,
        /// The dtypes this argument accepts, in words.
        supported: &'static str,
    },
    /// A tensor lives on another device than the one the `TensorKernels` was made for (candle
    /// CUDA devices are distinct per `Device::new_cuda*` call: each has its own stream).
    #[error("`{what}` is on {actual}, the kernels are for {expected}")]
    DeviceMismatch {
        /// Which argument.
        what: &'static str,
        /// The kernels' device (candle's `Debug` text of the device).
        expected: String,
        /// The tensor's device.
        actual: String,
    },
    /// A device that has no tensor kernels in this build (a Metal device, or a CUDA device in a
    /// build without the `cuda` feature).
    #[error("no tensor kernels for device {device}: {reason}")]
    UnsupportedDevice {
        /// candle's `Debug` text of the device.
        device: String,
        /// Why, in words.
        reason: &'static str,
    },
    /// A destination window `[offset, offset + len)` reaches past the end of the destination.
    #[error("`{what}`: elements [{offset}, {offset}+{len}) are out of range for a buffer of {buffer_len} elements")]
    OffsetOutOfRange {
        /// Which argument (the destination).
        what: &'static str,
        /// First element written (elements).
        offset: usize,
        /// Number of elements written.
        len: usize,
        /// Number of elements of the destination.
        buffer_len: usize,
    },
    /// Two tensors written by one kernel call share overlapping elements of one storage (e.g.
    /// the same tensor passed as `param` and `exp_avg`). Ranges are elements of the storage.
    #[error("`{first}` (storage elements [{first_start}, {first_end})) and `{second}` ([{second_start}, {second_end})) overlap in one storage and are both written")]
    AliasedBuffers {
        /// The first written argument.
        first: &'static str,
        /// Its first storage element.
        first_start: usize,
        /// One past its last storage element.
        first_end: usize,
        /// The second written argument.
        second: &'static str,
        /// Its first storage element.
        second_start: usize,
        /// One past its last storage element.
        second_end: usize,
    },
    /// A candle call of the tensor kernels (creating a tensor) failed; `message` is candle's
    /// own text.
    #[error("candle {call} failed: {message}")]
    Candle {
        /// The call, with its sizes (e.g. `Tensor::zeros(4096, bf16)`).
        call: String,
        /// candle's error text.
        message: String,
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
