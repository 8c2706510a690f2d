//! The `tokenrouter` binary: the commands live in the library (shared with the Python
//! package's console script).

fn main() -> std::process::ExitCode {
    std::process::ExitCode::from(tokenrouter::run_with_args(std::env::args_os()))
}
