//! Presentation helpers shared by the `tessera` command line. The binaries in `src/bin`
//! are thin: the work lives in the `crates/` libraries.

pub mod render;
pub mod timespec;

/// Logs of the daemons: to stderr, filtered by `TESSERA_LOG` (default `info`), coloured
/// only on a terminal.
pub fn init_logging() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("TESSERA_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .init();
}
