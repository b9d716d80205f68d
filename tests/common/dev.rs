//! `fencer dev` on free ports, killed when dropped: the one-process stack
//! the README starts, for tests of what a new user sees.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::{free_port, http_ok};

pub struct Dev {
    child: Child,
    pub api: String,
    pub proxy: String,
    pub gateway: String,
    pub admin: String,
    pub admin_port: u16,
}

impl Dev {
    /// Starts it (logs at warn, thrown away) and waits for `/readyz`.
    pub fn start() -> Dev {
        let [api, proxy, gw, st, admin] = [
            free_port(),
            free_port(),
            free_port(),
            free_port(),
            free_port(),
        ];
        let child = Command::new(env!("CARGO_BIN_EXE_fencer"))
            .arg("dev")
            .env("FENCER__SIDECAR__LISTEN", format!("127.0.0.1:{api}"))
            .env("FENCER__PROXY__LISTEN", format!("127.0.0.1:{proxy}"))
            .env("FENCER__GATEWAY__LISTEN", format!("127.0.0.1:{gw}"))
            .env("FENCER__STORAGE__LISTEN", format!("127.0.0.1:{st}"))
            .env("FENCER__ADMIN__LISTEN", format!("127.0.0.1:{admin}"))
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
