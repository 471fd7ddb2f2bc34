//! The time model's inputs: FLOP counts of every op and hardware profiles.

pub mod flops;
pub mod profile;

pub use profile::{
    builtin_profile, CollectiveCost, Collectives, CurvePoint, GemmCurve, GemmRates,
    HardwareProfile, HostLink, LinkCollectives, BUILTIN_PROFILE_NAMES, PROFILE_SCHEMA,
};
