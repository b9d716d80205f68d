//! `fencer dev` on free ports, killed when dropped: the one-process stack
//! the README starts, for tests of what a new user sees.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::{fencer_bin, free_port, http_ok};

pub struct Dev {
    child: Child,
    pub api: String,
    pub proxy: String,
    pub gateway: String,
    pub admin: String,
    pub admin_port: u16,
    /// Dapr's gRPC API, `127.0.0.1:PORT` (no scheme).
    pub dapr_grpc: String,
}

impl Dev {
    /// The command line of a `fencer dev` on free ports, and those ports
    /// (lock API, proxy, gateway, storage, metrics) — for a test that
    /// reads its output itself.
    pub fn command() -> (Command, [u16; 5]) {
        let (cmd, ports, _) = Dev::command_with_dapr_grpc();
        (cmd, ports)
    }

    /// [`Dev::command`], and the port of Dapr's gRPC API (never Dapr's
    /// default 50001: tests run side by side).
    pub fn command_with_dapr_grpc() -> (Command, [u16; 5], u16) {
        let ports = [
            free_port(),
            free_port(),
            free_port(),
            free_port(),
            free_port(),
        ];
        let mut cmd = Command::new(fencer_bin());
        cmd.arg("dev");
        let vars = [
            "FENCER__SIDECAR__LISTEN",
            "FENCER__PROXY__LISTEN",
            "FENCER__GATEWAY__LISTEN",
            "FENCER__STORAGE__LISTEN",
            "FENCER__ADMIN__LISTEN",
        ];
        for (var, port) in vars.iter().zip(ports) {
            cmd.env(var, format!("127.0.0.1:{port}"));
        }
        let grpc = free_port();
        cmd.env(
            "FENCER__SIDECAR__DAPR_GRPC_LISTEN",
            format!("127.0.0.1:{grpc}"),
        );
        (cmd, ports, grpc)
    }

    /// Starts it (logs at warn, thrown away) and waits for `/readyz`.
    pub fn start() -> Dev {
        let (mut cmd, [api, proxy, gw, _st, admin], grpc) = Dev::command_with_dapr_grpc();
        let child = cmd
            .env("FENCER__LOG__LEVEL", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let dev = Dev {
            child,
            api: format!("http://127.0.0.1:{api}"),
            proxy: format!("http://127.0.0.1:{proxy}"),
            gateway: format!("http://127.0.0.1:{gw}"),
            admin: format!("http://127.0.0.1:{admin}"),
            admin_port: admin,
            dapr_grpc: format!("127.0.0.1:{grpc}"),
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while !http_ok(&format!("{}/readyz", dev.admin)) {
            assert!(Instant::now() < deadline, "fencer dev did not become ready");
            std::thread::sleep(Duration::from_millis(50));
        }
        dev
    }

    /// Its `/metrics` text.
    pub async fn metrics(&self) -> String {
        reqwest::get(format!("{}/metrics", self.admin))
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }
}

impl Drop for Dev {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
