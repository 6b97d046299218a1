//! Waiting for the auth attempt records usher emits.

use std::time::Duration;
use tokio::sync::broadcast::Receiver;
use usher::auth::{AuthAttempt, AuthOutcome};

/// The next attempt by `user` (as given), skipping others; fails after 10 s.
pub async fn next_attempt(rx: &mut Receiver<AuthAttempt>, user: &str) -> AuthAttempt {
    tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match rx.recv().await {
                Ok(a) if a.user == user => return a,
                Ok(_) => {}
                Err(e) => panic!("auth attempts channel: {e}"),
            }
        }
    })
    .await
    .unwrap_or_else(|_| panic!("no auth attempt by {user:?} within 10 s"))
}

/// Asserts the next attempt by `user` ended with `outcome`; returns it.
pub async fn expect_outcome(
    rx: &mut Receiver<AuthAttempt>,
    user: &str,
    outcome: AuthOutcome,
) -> AuthAttempt {
    let a = next_attempt(rx, user).await;
    assert_eq!(a.outcome, outcome, "{a:?}");
    a
}
