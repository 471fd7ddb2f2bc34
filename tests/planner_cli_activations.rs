//! `fsdp plan --device cuda` / `--activations`: the flags choose the planner's activation model
//! (`ActivationModel`), bad combinations are usage errors, and the rendered table and JSON say
//! which model the plan used.

use fsdp::cli::plan::{
    config_from_args, run, ActivationsArg, Format, GradSyncArg, OptimizerArg, PlanArgs,
    PlanDeviceArg, StrategyArg,
};
use fsdp::cli::CliError;
use fsdp_planner::ActivationModel;

fn args(device: PlanDeviceArg, activations: ActivationsArg) -> PlanArgs {
    PlanArgs {
        model: Some("mini".into()),
        hf_config: None,
        safetensors: None,
        spec: None,
        world_size: 2,
        strategy: StrategyArg::FullShard,
        shard_size: None,
        activation_checkpointing: None,
        offload: None,
        ckpt_async: false,
        param_dtype: fsdp::cli::args::DTypeArg::Bf16,
        reduce_dtype: fsdp::cli::args::DTypeArg::F32,
        optimizer: OptimizerArg::Adamw,
        momentum: 0.9,
        micro_batch: 4,
        seq_len: Some(256),
        grad_accum: 1,
        grad_sync: GradSyncArg::Every,
        prefetch: 1,
        alignment: 1,
        device: Some(device),
        activations,
        device_memory: None,
        format: Format::Json,
        output: None,
        time: false,
        hardware: None,
        trace: None,
    }
}

#[test]
fn device_picks_the_activation_model() {
    use ActivationsArg as A;
    use PlanDeviceArg as D;
    for (d, a, want) in [
        (D::Cpu, A::Auto, ActivationModel::Fused),
        (D::Cpu, A::Fused, ActivationModel::Fused),
        (D::Cpu, A::Composite, ActivationModel::Composite),
        (D::Cuda, A::Auto, ActivationModel::Composite),
        (D::Cuda, A::Composite, ActivationModel::Composite),
    ] {
        assert_eq!(config_from_args(&args(d, a)).unwrap().activations, want);
    }
    match config_from_args(&args(D::Cuda, A::Fused)) {
        Err(CliError::Usage(m)) => {
            assert!(m.contains("--activations fused is the CPU ops path"), "{m}")
        }
        other => panic!("expected a usage error, got {other:?}"),
    }
}

#[test]
fn json_and_table_name_the_model() {
    let dir = tempfile::tempdir().unwrap();
    let read = |a: PlanArgs, name: &str| -> String {
        let path = dir.path().join(name);
        run(PlanArgs {
            output: Some(path.clone()),
            ..a
        })
        .unwrap();
        std::fs::read_to_string(path).unwrap()
    };
    let cuda: serde_json::Value = serde_json::from_str(&read(
        args(PlanDeviceArg::Cuda, ActivationsArg::Auto),
        "c.json",
    ))
    .unwrap();
    let cpu: serde_json::Value = serde_json::from_str(&read(
        args(PlanDeviceArg::Cpu, ActivationsArg::Auto),
        "f.json",
    ))
    .unwrap();
    assert_eq!(cuda["memory"]["activation_model"], "composite");
    assert_eq!(cuda["config"]["activations"], "composite");
    assert_eq!(cpu["memory"]["activation_model"], "fused");
    assert!(cpu["config"].get("activations").is_none());
    // bf16 mini at 4 x 256: the composite ops keep about 4x the fused ops' block activations.
    let peak = |v: &serde_json::Value| v["memory"]["peak"]["bytes"].as_u64().unwrap();
    assert!(
        peak(&cuda) > 2 * peak(&cpu),
        "{} vs {}",
        peak(&cuda),
        peak(&cpu)
    );
    assert_ne!(cuda["fingerprint"], cpu["fingerprint"]);
    let table = read(
        PlanArgs {
            format: Format::Table,
            ..args(PlanDeviceArg::Cuda, ActivationsArg::Auto)
        },
        "c.txt",
    );
    assert!(table.contains("activations composite ops (CUDA"), "{table}");
}
