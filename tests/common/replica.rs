//! A streaming replica of a [`PgCluster`] (pg_basebackup -R from it, as the
//! postgres OS user, in a folder of its own, on its own port), and what a
//! fail-over test does to a cluster: stop it fast, promote a standby.

use super::{free_port, pg_command, run_ok, PgCluster};
use std::io::Write;
use std::process::Command;

impl PgCluster {
    /// A hot standby streaming from this cluster (which allows local
    /// replication connections: initdb's default pg_hba.conf), started and
    /// accepting read-only connections; stopped when dropped.
    pub fn start_replica(&self) -> PgCluster {
        let tmp = tempfile::Builder::new()
            .prefix("usher-pg-replica-")
            .tempdir()
            .unwrap();
        let dir = tmp.path().to_path_buf();
        if super::is_root() {
            let mut c = Command::new("chown");
            c.arg("postgres:postgres").arg(&dir);
            run_ok(c, "chown");
        }
        let data = dir.join("data");
        let mut backup = pg_command(&self.bin, "pg_basebackup");
        backup
            .arg("-h")
            .arg(&self.dir)
            .args(["-p", &self.port.to_string(), "-U", "postgres", "-D"])
            .arg(&data)
            .args(["-R", "-X", "stream", "-c", "fast"]);
        run_ok(backup, "pg_basebackup");
        // Its own socket folder; the last `port` line (below) wins over the
        // primary's, copied with the rest of postgresql.conf.
        std::fs::OpenOptions::new()
            .append(true)
            .open(data.join("postgresql.conf"))
            .unwrap()
            .write_all(format!("unix_socket_directories = '{}'\n", dir.display()).as_bytes())
            .unwrap();
        let mut replica = PgCluster {
            port: 0,
            dir,
            bin: self.bin.clone(),
            _tmp: tmp,
        };
        for attempt in 1.. {
            replica.port = free_port();
            std::fs::OpenOptions::new()
                .append(true)
                .open(data.join("postgresql.conf"))
                .unwrap()
                .write_all(format!("port = {}\n", replica.port).as_bytes())
                .unwrap();
            let out = replica.pg_ctl_start_output();
            if out.status.success() {
                break;
            }
            let log = std::fs::read_to_string(replica.dir.join("log")).unwrap_or_default();
            assert!(
                log.contains("Address already in use") && attempt < 5,
                "pg_ctl start (replica) failed: {}\n{}\n{log}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        replica
    }

    /// pg_ctl stop -m fast: sessions are ended (57P01), the server shuts
    /// down cleanly, and connections are refused once it returns.
    pub fn stop_fast(&self) {
        let mut c = pg_command(&self.bin, "pg_ctl");
        c.arg("-D")
            .arg(self.data())
            .args(["-m", "fast", "-w", "stop"]);
        run_ok(c, "pg_ctl stop -m fast");
    }

    /// pg_ctl promote: the standby leaves recovery (waits until it has).
    pub fn promote(&self) {
        let mut c = pg_command(&self.bin, "pg_ctl");
        c.arg("-D").arg(self.data()).args(["-w", "promote"]);
        run_ok(c, "pg_ctl promote");
    }
}
