//! The test harness itself: waiting for events, and starting the usher
//! binary when its port is taken.

use crate::common::wait::{eventually, eventually_async, wait_for, DEADLINE};
use crate::common::{PgCluster, UsherProcess};
use std::time::Duration;

#[test]
fn a_wait_returns_once_the_condition_holds() {
    let mut polls = 0;
    let n = wait_for(DEADLINE, "the third poll", || {
        polls += 1;
        if polls == 3 {
            Ok(polls)
        } else {
            Err(polls)
        }
    });
    assert_eq!(n, 3);
}

#[test]
#[should_panic(expected = "never true: not within")]
fn a_wait_fails_at_its_deadline_naming_what_it_waited_for() {
    eventually(Duration::from_millis(50), "never true", || false);
}

#[tokio::test]
#[should_panic(expected = "never true either: not within")]
async fn an_async_wait_fails_at_its_deadline() {
    eventually_async(Duration::from_millis(50), "never true either", || async {
        false
    })
    .await;
}

/// free_port() can hand out a port another process takes before usher
/// binds it: usher exits, and the builder starts it again on another port.
/// The port's owner answers connections, so only usher's own listening
/// socket counts as started.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usher_is_started_again_on_another_port_when_its_port_is_taken() {
    let pg = PgCluster::shared();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken_port = taken.local_addr().unwrap().port();
    let usher = UsherProcess::builder(pg).first_port(taken_port).start();
    assert_ne!(usher.port, taken_port);
    let (c, _driver) = usher.alice().await;
    c.simple_query("SELECT 1").await.unwrap();
    drop(taken);
}

/// The same race for PostgreSQL: a cluster whose port was taken is started
/// again on another port.
#[test]
fn a_cluster_is_started_again_on_another_port_when_its_port_is_taken() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken_port = taken.local_addr().unwrap().port();
    let pg = PgCluster::start_first_on(Some(taken_port));
    assert_ne!(pg.port, taken_port);
    assert_eq!(pg.psql_super("SELECT 1"), "1");
    drop(taken);
}
