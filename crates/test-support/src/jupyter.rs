//! A real Jupyter Kernel Gateway for the remote sessions' tests: `jupyter kernelgateway` from
//! the venv that `cargo xtask fixtures` makes (`<cache>/venv-jupyter`), on 127.0.0.1 at a free
//! port, with a token, stopped when dropped. Blocking, so that async tests and the binary's
//! tests use it alike.

use std::{
    io::{Read, Write},
    net::TcpStream,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use crate::{ScratchDir, cache_dir};

/// The token every test gateway requires.
pub const TOKEN: &str = "test-token-3f9c";
/// The longest a helper waits for the gateway to do something.
const PATIENCE: Duration = Duration::from_secs(60);

/// A `jupyter kernelgateway` of one test, stopped when dropped.
#[derive(Debug)]
pub struct JupyterGateway {
    child: Child,
    /// `http://127.0.0.1:<port>`.
    pub url: String,
    /// Its runtime, config and log folder.
    pub dir: ScratchDir,
}

impl JupyterGateway {
    /// Starts a gateway with the extra options `options` (`--MappingKernelManager...`) and
    /// waits until it answers. Fails saying what to run when the venv is missing.
    #[track_caller]
    pub fn start(name: &str, options: &[&str]) -> JupyterGateway {
        let jupyter = cache_dir().join("venv-jupyter").join("bin").join("jupyter");
        assert!(
            jupyter.is_file(),
            "{} is missing: run `cargo xtask fixtures` to make the venv with Jupyter Kernel \
             Gateway (the `fixtures` nextest profile runs these tests)",
            jupyter.display()
        );
        let dir = ScratchDir::new(&format!("jupyter-{name}"));
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|listener| listener.local_addr())
            .expect("a free port")
            .port();
        let log = std::fs::File::create(dir.join("gateway.log")).expect("the gateway's log");
        let mut command = Command::new("timeout");
        // Bounded even if the test process dies without stopping it.
        command
            .args(["--kill-after=5", "900"])
            .arg(&jupyter)
            .arg("kernelgateway")
            .arg("--KernelGatewayApp.ip=127.0.0.1")
            .arg(format!("--KernelGatewayApp.port={port}"))
            .arg("--KernelGatewayApp.port_retries=0")
            .arg(format!("--KernelGatewayApp.auth_token={TOKEN}"))
            .arg("--JupyterWebsocketPersonality.list_kernels=True")
            .args(options);
        for (variable, sub) in [
            ("JUPYTER_RUNTIME_DIR", "runtime"),
            ("JUPYTER_CONFIG_DIR", "config"),
            ("JUPYTER_DATA_DIR", "data"),
            ("IPYTHONDIR", "ipython"),
        ] {
            command.env(variable, dir.join(sub));
        }
        command
            .current_dir(&*dir)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("the log, twice"))
            .stderr(log);
        let child = command.spawn().expect("`timeout` starts the gateway");
        let mut gateway = JupyterGateway {
            child,
            url: format!("http://127.0.0.1:{port}"),
            dir,
        };
        gateway.wait_until_up();
        gateway
    }

    fn wait_until_up(&mut self) {
        let deadline = Instant::now() + PATIENCE;
        loop {
            if self
                .request("GET", "/api")
                .is_ok_and(|(status, _)| status == 200)
            {
                return;
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!(
                    "the gateway ended ({status}) before it answered:\n{}",
                    self.log()
                );
            }
            assert!(
                Instant::now() < deadline,
                "the gateway did not answer within {PATIENCE:?}:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// One HTTP/1.0 request with the token: the answer's status and body.
    pub fn request(&self, method: &str, path: &str) -> std::io::Result<(u16, String)> {
        let address = self.url.trim_start_matches("http://");
        let mut stream = TcpStream::connect(address)?;
        stream.set_read_timeout(Some(Duration::from_secs(10)))?;
        write!(
            stream,
            "{method} {path} HTTP/1.0\r\nHost: {address}\r\nAuthorization: token {TOKEN}\r\n\
             Content-Length: 0\r\n\r\n"
        )?;
        let mut answer = String::new();
        stream.read_to_string(&mut answer)?;
        let status = answer
            .split(' ')
            .nth(1)
            .and_then(|code| code.parse().ok())
            .ok_or_else(|| std::io::Error::other(format!("not HTTP: {answer:.200}")))?;
        let body = answer
            .split_once("\r\n\r\n")
            .map(|(_, body)| body.to_owned())
            .unwrap_or_default();
        Ok((status, body))
    }

    /// The gateway's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("gateway.log")).unwrap_or_default()
    }

    /// The ids of the kernels the gateway has (`GET /api/kernels`).
    #[track_caller]
    pub fn kernels(&self) -> Vec<String> {
        // A kernel that is starting or restarting can make the listing fail for a moment
        // (HTTP 500 while its model is incomplete): asked again, briefly.
        let deadline = Instant::now() + Duration::from_secs(10);
        let (status, body) = loop {
            let (status, body) = self
                .request("GET", "/api/kernels")
                .expect("GET /api/kernels");
            if status < 500 || Instant::now() > deadline {
                break (status, body);
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        assert_eq!(status, 200, "GET /api/kernels: {body}");
        let listed: Vec<serde_json::Value> =
            serde_json::from_str(&body).expect("a list of kernels");
        listed
            .iter()
            .filter_map(|kernel| kernel["id"].as_str().map(str::to_owned))
            .collect()
    }

    /// Deletes kernel `id` by hand; whether the gateway had it.
    #[track_caller]
    pub fn delete(&self, id: &str) -> bool {
        let (status, body) = self
            .request("DELETE", &format!("/api/kernels/{id}"))
            .expect("DELETE");
        assert!(matches!(status, 204 | 404), "DELETE {id}: {status} {body}");
        status == 204
    }

    /// Waits until the gateway has none of `ids`; fails naming `what` after `patience`.
    #[track_caller]
    pub fn wait_until_gone(&self, ids: &[String], patience: Duration, what: &str) {
        let deadline = Instant::now() + patience;
        loop {
            let listed = self.kernels();
            if !ids.iter().any(|id| listed.contains(id)) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{what}: kernels {ids:?} still there after {patience:?} (it has {listed:?}):\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for JupyterGateway {
    fn drop(&mut self) {
        // SIGTERM: `timeout` passes it on, and the gateway shuts its kernels down.
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
