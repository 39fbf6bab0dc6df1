//! Diagnostics of the libraries under the shim (`tracing`) reach the
//! application's stderr: errors by default, `NPRDMA_LOG` (an env-filter
//! directive such as `warn` or `nprdma=debug`) selects more.

use std::sync::Once;

/// Install the stderr subscriber once per process (no-op if the program
/// installed its own `tracing` subscriber).
pub fn init() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let filter = std::env::var("NPRDMA_LOG")
            .ok()
            .and_then(|s| tracing_subscriber::EnvFilter::try_new(s).ok())
            .unwrap_or_else(|| tracing_subscriber::EnvFilter::new("error"));
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .with_ansi(false)
            .try_init();
    });
}
