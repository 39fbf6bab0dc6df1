pub fn cmd_eval(_a: EvalArgs) -> crate::error::Result<()> { Ok(()) }
#[derive(clap::Args, Debug)] pub struct EvalArgs {}
