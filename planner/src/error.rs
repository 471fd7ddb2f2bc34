//! The planner's one error type.

use thiserror::Error;

/// Everything that can go wrong while reading a model description or planning it. Each variant
/// carries the numbers or names needed to fix the input; the CLI maps every variant to exit code 2.
#[derive(Debug, Error)]
pub enum PlanError {
    /// A preset name that is not built in.
    #[error("unknown model preset `{name}` (known: {known})")]
    UnknownPreset {
        /// The name given.
        name: String,
        /// Comma-separated list of presets.
        known: String,
    },
    /// World size 0.
    #[error("world size must be at least 1, got {0}")]
    ZeroWorldSize(u64),
    /// A hybrid shard size that does not divide the world size.
    #[error("shard size {shard_size} does not divide world size {world_size}")]
    ShardSizeNotDivisor {
        /// Requested shard-group size.
        shard_size: u64,
        /// World size.
        world_size: u64,
    },
    /// A tied parameter whose target lives in another unit (or does not exist).
    #[error("parameter `{param}` in unit `{unit}` is tied to `{target}`, which is not in the same unit{}", if .found_in.is_empty() { String::from(" (and not in the model)") } else { format!(" (it is in unit `{}`)", .found_in) })]
    TiedAcrossUnits {
        /// The tied parameter.
        param: String,
        /// Its unit.
        unit: String,
        /// The parameter it is tied to.
        target: String,
        /// Unit holding the target, empty if none.
        found_in: String,
    },
    /// A parameter with a zero-size dimension, or a malformed model spec.
    #[error("invalid model spec: {0}")]
    InvalidSpec(String),
    /// Alignment 0.
    #[error("alignment must be at least 1 element, got 0")]
    ZeroAlignment,
    /// An invalid configuration value (micro-batch 0, grad accumulation 0, ...).
    #[error("invalid configuration: {0}")]
    InvalidConfig(String),
    /// A Hugging Face `config.json` lacking a required field.
    #[error("{file}: missing field `{field}` ({family} config)")]
    MissingField {
        /// The file read.
        file: String,
        /// The field name.
        field: String,
        /// The model family the file was read as.
        family: String,
    },
    /// A malformed file (JSON syntax, truncated safetensors header, bad offsets).
    #[error("{file}: {problem}")]
    BadFile {
        /// The file read.
        file: String,
        /// What is wrong, with the numbers.
        problem: String,
    },
    /// A hardware profile (`fsdp-hardware/1` JSON, [`crate::time::HardwareProfile`]) with a
    /// missing, unknown, negative, zero or non-finite value, or a malformed document.
    #[error(
        "hardware profile {origin}: `{field}` {problem}; fix it, or measure this machine again \
         with `fsdp calibrate -o FILE`"
    )]
    BadProfile {
        /// Where the profile came from (a file name, or `built-in NAME`).
        origin: String,
        /// The JSON path of the field (`collectives.intra_node.all_gather.latency_s`,
        /// `gemm.bf16.points[2].flops_per_s`), or `(document)` for a syntax error.
        field: String,
        /// What is wrong and how to fix it.
        problem: String,
    },
    /// A built-in hardware profile name that does not exist.
    #[error(
        "unknown hardware `{name}` (built in: {known}; or give the path of a profile JSON file)"
    )]
    UnknownHardware {
        /// The name given.
        name: String,
        /// Comma-separated built-in names.
        known: String,
    },
    /// An I/O error, with the path.
    #[error("{path}: {source}")]
    Io {
        /// The path.
        path: String,
        /// The underlying error.
        source: std::io::Error,
    },
}
