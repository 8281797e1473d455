//! Starting the real `gateway` binary with a config written by the test.

use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::build::binaries;
use crate::http::{self, Response};

pub struct Gateway {
    child: Child,
    pub addr: SocketAddr,
    pub config_path: PathBuf,
    logs: Arc<Mutex<String>>,
    _dir: tempfile::TempDir,
}

/// Why a gateway did not come up.
#[derive(Debug)]
pub struct StartError {
    pub status: Option<std::process::ExitStatus>,
    pub logs: String,
}

impl Gateway {
    /// Starts a gateway with this config (YAML). `{model}`, `{reference}`
    /// and `{mismatch}` in the text are replaced by the tiny model's path
    /// and the test plugins' paths, `{dflash_drafter}` and `{mtp_drafter}`
    /// by drafters for that model. Waits until it listens.
    pub fn start(config: &str) -> Gateway {
        Self::try_start(config, &[])
            .unwrap_or_else(|e| panic!("gateway did not start ({:?}):\n{}", e.status, e.logs))
    }

    pub fn start_with_env(config: &str, env: &[(&str, &str)]) -> Gateway {
        Self::try_start(config, env)
            .unwrap_or_else(|e| panic!("gateway did not start ({:?}):\n{}", e.status, e.logs))
    }

    pub fn try_start(config: &str, env: &[(&str, &str)]) -> Result<Gateway, StartError> {
        Self::try_start_on(config, env, 0)
    }

    /// Starts on `port` (0: any free one), as a restarted server takes its
    /// old address again.
    pub fn try_start_on(
        config: &str,
        env: &[(&str, &str)],
        port: u16,
    ) -> Result<Gateway, StartError> {
        let bins = binaries();
        let text = config
            .replace(
                "{model}",
                &crate::models::tiny_qwen3().display().to_string(),
            )
            .replace("{reference}", &bins.reference_plugin.display().to_string())
            .replace("{mismatch}", &bins.mismatch_plugin.display().to_string());
        // Drafters are written only for configs that name them.
        let text = ["dflash", "mtp"].iter().fold(text, |text, kind| {
            let key = format!("{{{kind}_drafter}}");
            if text.contains(&key) {
                let path = crate::models::tiny_qwen3_drafter(kind);
                text.replace(&key, &path.display().to_string())
            } else {
                text
            }
        });
        let dir = tempfile::tempdir().expect("tempdir");
        let config_path = dir.path().join("config.yaml");
        std::fs::write(&config_path, text).expect("write config");
        let mut cmd = Command::new(&bins.gateway);
        cmd.args(["serve", "--config"])
            .arg(&config_path)
            .args(["--port", &port.to_string()])
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn gateway");
        let logs = Arc::new(Mutex::new(String::new()));
        let stderr = child.stderr.take().expect("stderr");
        {
            let logs = logs.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                    let mut l = logs.lock().unwrap();
                    l.push_str(&line);
                    l.push('\n');
                }
            });
        }
        let mut stdout = BufReader::new(child.stdout.take().expect("stdout"));
        let mut line = String::new();
        let addr = loop {
            line.clear();
            if stdout.read_line(&mut line).unwrap_or(0) == 0 {
                let status = child.wait().ok();
                // Let the stderr reader drain.
                std::thread::sleep(Duration::from_millis(100));
                let logs = logs.lock().unwrap().clone();
                return Err(StartError { status, logs });
            }
            if let Some(rest) = line.trim().strip_prefix("gateway listening on http://") {
                break rest.parse::<SocketAddr>().expect("address");
            }
        };
        // Keep draining stdout so the child never blocks on it.
        std::thread::spawn(move || {
            let _ = stdout.read_to_end(&mut Vec::new());
        });
        Ok(Gateway {
            child,
            addr,
            config_path,
            logs,
            _dir: dir,
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends SIGTERM, as a service manager stopping the server would.
    pub fn terminate(&self) {
        let status = Command::new("kill")
            .args(["-TERM", &self.pid().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -TERM failed");
    }

    /// The exit status, once the process has exited within `timeout`.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    /// Everything the gateway logged so far.
    pub fn logs(&self) -> String {
        self.logs.lock().unwrap().clone()
    }

    /// Whether the log shows `text` within 10 s: the log is read from the
    /// process's stderr by a thread of its own, so a line the gateway just
    /// wrote may not be here yet.
    pub fn logged(&self, text: &str) -> bool {
        self.wait_for(Duration::from_secs(10), |gw| gw.logs().contains(text))
    }

    pub fn get(&self, path: &str) -> Response {
        http::get(self.addr, path)
    }

    pub fn post(&self, path: &str, body: &Value) -> Response {
        http::post_json(self.addr, path, body)
    }

    pub fn health(&self) -> Value {
        self.get("/health").json()
    }

    /// Polls until `check` holds or `timeout` passes.
    pub fn wait_for(&self, timeout: Duration, mut check: impl FnMut(&Gateway) -> bool) -> bool {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if check(self) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        check(self)
    }

    /// One sample of a Prometheus metric with these labels (all must
    /// match), if present.
    pub fn metric(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let text = self.get("/metrics").text();
        metric_value(&text, name, labels)
    }

    pub fn config_path(&self) -> &Path {
        &self.config_path
    }

    /// Resident memory of the gateway process in bytes.
    pub fn rss_bytes(&self) -> u64 {
        self.status_bytes("VmRSS")
    }

    /// A memory figure of the gateway process's `/proc/<pid>/status`
    /// (`VmRSS`, `RssAnon`: its heap, `RssFile`: mapped files, its
    /// libraries' code among them), in bytes.
    pub fn status_bytes(&self, key: &str) -> u64 {
        let status =
            std::fs::read_to_string(format!("/proc/{}/status", self.pid())).expect("proc status");
        status
            .lines()
            .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|kb| kb.parse::<u64>().ok())
            .map(|kb| kb * 1024)
            .unwrap_or_else(|| panic!("{key} in /proc/{}/status", self.pid()))
    }
}

pub fn metric_value(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (series, value) = l.rsplit_once(' ')?;
        let (metric, rest) = match series.split_once('{') {
            Some((m, r)) => (m, r),
            None => (series, ""),
        };
        if metric != name {
            return None;
        }
        let all = labels
            .iter()
            .all(|(k, v)| rest.contains(&format!("{k}=\"{v}\"")));
        all.then(|| value.parse().ok()).flatten()
    })
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
