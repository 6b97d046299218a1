//! `usher.shared`: a small key-value store shared by all Lua VMs, bounded in
//! size, with optional expiry, that survives hook reloads.

use lru::LruCache;
use parking_lot::Mutex;
use std::num::NonZeroUsize;
use std::time::{Duration, Instant};

/// A value in the shared store.
#[derive(Debug, Clone, PartialEq)]
pub enum SharedValue {
    Str(String),
    Int(i64),
    Num(f64),
    Bool(bool),
}

/// What a hook asked of the store that it cannot do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SharedError {
    #[error("usher.shared.incr: \"{key}\" does not hold an integer")]
    NotAnInteger { key: String },
}

/// The store. One short-held mutex: hooks that use it pay for it, nothing
/// else touches it.
#[derive(Debug)]
pub struct SharedStore {
    entries: Mutex<LruCache<String, (SharedValue, Option<Instant>)>>,
}

impl SharedStore {
    /// A store of at most `max_keys` keys; the least recently used go first.
    pub fn new(max_keys: usize) -> Self {
        SharedStore {
            entries: Mutex::new(LruCache::new(NonZeroUsize::new(max_keys.max(1)).unwrap())),
        }
    }

    pub fn get(&self, key: &str) -> Option<SharedValue> {
        let mut entries = self.entries.lock();
        match entries.get(key) {
            Some((_, Some(expiry))) if *expiry <= Instant::now() => {
                entries.pop(key);
                None
            }
            Some((v, _)) => Some(v.clone()),
            None => None,
        }
    }

    /// Sets `key`; `ttl` of `None` keeps it until evicted or deleted.
    pub fn set(&self, key: &str, value: SharedValue, ttl: Option<Duration>) {
        let expiry = ttl.map(|t| Instant::now() + t);
        self.entries.lock().put(key.to_string(), (value, expiry));
    }

    /// Adds `by` to an integer (a missing or expired key counts as 0) and
    /// returns the new value. A `ttl` applies when the key is created.
    pub fn incr(&self, key: &str, by: i64, ttl: Option<Duration>) -> Result<i64, SharedError> {
        let mut entries = self.entries.lock();
        let now = Instant::now();
        if let Some((value, expiry)) = entries.get_mut(key) {
            if expiry.is_none_or(|e| e > now) {
                return match value {
                    SharedValue::Int(n) => {
                        *n = n.saturating_add(by);
                        Ok(*n)
                    }
                    _ => Err(SharedError::NotAnInteger {
                        key: key.to_string(),
                    }),
                };
            }
        }
        entries.put(
            key.to_string(),
            (SharedValue::Int(by), ttl.map(|t| now + t)),
        );
        Ok(by)
    }

    pub fn delete(&self, key: &str) -> bool {
        self.entries.lock().pop(key).is_some()
    }

    pub fn len(&self) -> usize {
        self.entries.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_with_expiry_and_counters() {
        let s = SharedStore::new(2);
        s.set("a", SharedValue::Str("x".into()), None);
        s.set("b", SharedValue::Bool(true), Some(Duration::from_millis(1)));
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(s.get("b"), None, "expired");
        assert_eq!(s.incr("n", 2, None), Ok(2));
        assert_eq!(s.incr("n", 3, None), Ok(5));
        s.set("c", SharedValue::Int(1), None);
        assert!(s.len() <= 2, "bounded");
        assert!(s.incr("c", 1, None).is_ok());
        s.set("s", SharedValue::Str("x".into()), None);
        assert!(s.incr("s", 1, None).is_err());
        assert!(s.delete("s"));
        assert_eq!(s.get("s"), None);
    }
}
