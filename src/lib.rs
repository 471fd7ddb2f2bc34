//! fsdp-suite: holds the workspace's cross-crate tests (`tests/`) and benches (`benches/`).
//! It has no code of its own.
