pub fn cmd_reg(_a: RegArgs) -> crate::error::Result<()> { Ok(()) }
#[derive(clap::Args, Debug)] pub struct RegArgs {}
