//! What the differential runs share (tests/it/settings.rs,
//! tests/it/extended_protocol.rs): the run's size, seeds and configurations
//! from the environment, and the trail a failure prints.
//!
//! USHER_DIFF_SEED=<seed> replays one seed; USHER_DIFF_CONFIGS (space
//! separated, e.g. `transaction/1 session/2`) picks the configurations;
//! USHER_DIFF_SEEDS (seeds per configuration), USHER_DIFF_STEPS (steps per
//! seed) and USHER_DIFF_FIRST_SEED set the run's size and its seeds.

/// A run's seeds, steps and configurations.
pub struct Plan {
    pub seeds: Vec<u64>,
    pub steps: usize,
    pub configs: Vec<String>,
}

fn number(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .map(|v| v.parse().unwrap_or_else(|_| panic!("{name}={v}: a number")))
        .unwrap_or(default)
}

impl Plan {
    /// The plan the environment asks for, else `seeds` seeds from 1 of
    /// `steps` steps on each of `configs` (space separated).
    pub fn from_env(seeds: u64, steps: u64, configs: &str) -> Plan {
        let steps = number("USHER_DIFF_STEPS", steps) as usize;
        let seeds = match std::env::var("USHER_DIFF_SEED") {
            Ok(seed) => vec![seed.parse().expect("USHER_DIFF_SEED: a number")],
            Err(_) => {
                let first = number("USHER_DIFF_FIRST_SEED", 1);
                (first..first + number("USHER_DIFF_SEEDS", seeds)).collect()
            }
        };
        let configs = std::env::var("USHER_DIFF_CONFIGS").unwrap_or_else(|_| configs.into());
        Plan {
            seeds,
            steps,
            configs: configs.split_whitespace().map(String::from).collect(),
        }
    }
}

/// What a run did, for the failure message: what ran (with how to replay
/// it) and a line per step.
pub struct Trail {
    pub what: String,
    pub log: Vec<String>,
}

impl Trail {
    pub fn new(what: String) -> Trail {
        Trail {
            what,
            log: Vec::new(),
        }
    }

    /// Fails the test with the run, the step, `message` and the last 200
    /// steps.
    pub fn fail(&self, step: usize, message: String) -> ! {
        let from = self.log.len().saturating_sub(200);
        panic!(
            "{}\nfailed at step {step}: {message}\nlast steps:\n{}",
            self.what,
            self.log[from..].join("\n")
        );
    }
}
