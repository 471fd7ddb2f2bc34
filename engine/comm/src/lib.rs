//! placeholder crate root, replaced below.
