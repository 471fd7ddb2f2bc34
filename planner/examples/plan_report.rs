//! Plans a preset and writes its table, JSON and SVG without building the engine:
//! `cargo run -p fsdp-planner --example plan_report -- llama3-8b 8 80GiB out_dir`.

use fsdp_planner::{plan, preset, report, PlanConfig};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a: Vec<String> = std::env::args().collect();
    let spec = preset(a.get(1).map_or("gpt2", |s| s.as_str()))?;
    let mut cfg = PlanConfig::new(a.get(2).map_or(Ok(8), |s| s.parse())?);
    cfg.device_memory = a.get(3).map(|s| s.parse()).transpose()?;
    let out = std::path::PathBuf::from(a.get(4).map_or("/tmp", |s| s.as_str()));
    let p = plan(&spec, &cfg)?;
    let fit = report::fit_report(&spec, &p)?;
    print!("{}", report::render_table(&p, fit.as_ref()));
    std::fs::write(out.join("plan.svg"), report::render_svg(&p))?;
    std::fs::write(
        out.join("plan.json"),
        serde_json::to_string_pretty(&report::render_json(&p, fit.as_ref()))?,
    )?;
    Ok(())
}
