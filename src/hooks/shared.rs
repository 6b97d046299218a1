//! `usher.shared`: a small key-value store shared by all Lua VMs, bounded in
//! keys and in bytes, with optional expiry, that survives hook reloads.

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

impl SharedValue {
    /// Its bytes against `hooks.shared_max_bytes` (a number or boolean
    /// counts 8).
    fn bytes(&self) -> usize {
        match self {
            SharedValue::Str(s) => s.len(),
            _ => 8,
        }
    }
}

/// What a hook asked of the store that it cannot do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SharedError {
    #[error("usher.shared.incr: \"{key}\" does not hold an integer")]
    NotAnInteger { key: String },
    #[error("usher.shared: \"{key}\" and its value take {bytes} bytes, more than the whole store may hold (hooks.shared_max_bytes: {max})")]
    TooLarge {
        key: String,
        bytes: usize,
        max: usize,
    },
}

type Entry = (SharedValue, Option<Instant>);

/// The entries and the bytes they take (keys and values).
#[derive(Debug)]
struct Entries {
    lru: LruCache<String, Entry>,
    bytes: usize,
}

impl Entries {
    fn remove(&mut self, key: &str) -> Option<Entry> {
        let entry = self.lru.pop(key)?;
        self.bytes -= key.len() + entry.0.bytes();
        Some(entry)
    }

    /// Puts an entry that fits, then evicts the least recently used
    /// until the store is within its bounds again.
    fn put(&mut self, key: &str, entry: Entry, max_bytes: usize) {
        self.remove(key);
        self.bytes += key.len() + entry.0.bytes();
        if let Some((k, (v, _))) = self.lru.push(key.to_string(), entry) {
            self.bytes -= k.len() + v.bytes(); // the key bound evicted one
        }
        while self.bytes > max_bytes {
            match self.lru.pop_lru() {
                Some((k, (v, _))) => self.bytes -= k.len() + v.bytes(),
                None => break,
            }
        }
    }
}

/// The store. One short-held mutex: hooks that use it pay for it, nothing
/// else touches it.
#[derive(Debug)]
pub struct SharedStore {
    entries: Mutex<Entries>,
    max_bytes: usize,
}

impl SharedStore {
    /// A store of at most `max_keys` keys taking at most `max_bytes` bytes
    /// (keys and values); the least recently used go first. An entry
    /// larger than `max_bytes` is refused.
    pub fn new(max_keys: usize, max_bytes: usize) -> Self {
        SharedStore {
            entries: Mutex::new(Entries {
                lru: LruCache::new(NonZeroUsize::new(max_keys.max(1)).unwrap()),
                bytes: 0,
            }),
            max_bytes,
        }
    }

    pub fn get(&self, key: &str) -> Option<SharedValue> {
        let mut entries = self.entries.lock();
        match entries.lru.get(key) {
            Some((_, Some(expiry))) if *expiry <= Instant::now() => {
                entries.remove(key);
                None
            }
            Some((v, _)) => Some(v.clone()),
            None => None,
        }
    }

    fn fits(&self, key: &str, value: &SharedValue) -> Result<(), SharedError> {
        let bytes = key.len().saturating_add(value.bytes());
        if bytes > self.max_bytes {
            return Err(SharedError::TooLarge {
                key: crate::protocol::error::shown(key, 64),
                bytes,
                max: self.max_bytes,
            });
        }
        Ok(())
    }

    /// Sets `key`; `ttl` of `None` keeps it until evicted or deleted.
    pub fn set(
        &self,
        key: &str,
        value: SharedValue,
        ttl: Option<Duration>,
    ) -> Result<(), SharedError> {
        self.fits(key, &value)?;
        let expiry = ttl.map(|t| Instant::now() + t);
        self.entries
            .lock()
            .put(key, (value, expiry), self.max_bytes);
        Ok(())
    }

    /// Adds `by` to an integer (a missing or expired key counts as 0) and
    /// returns the new value. A `ttl` applies when the key is created.
    pub fn incr(&self, key: &str, by: i64, ttl: Option<Duration>) -> Result<i64, SharedError> {
        let mut entries = self.entries.lock();
        let now = Instant::now();
        if let Some((value, expiry)) = entries.lru.get_mut(key) {
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
        let value = SharedValue::Int(by);
        self.fits(key, &value)?;
        entries.put(key, (value, ttl.map(|t| now + t)), self.max_bytes);
        Ok(by)
    }

    pub fn delete(&self, key: &str) -> bool {
        self.entries.lock().remove(key).is_some()
    }

    pub fn len(&self) -> usize {
        self.entries.lock().lru.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes the entries take (keys and values).
    pub fn bytes(&self) -> usize {
        self.entries.lock().bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_with_expiry_and_counters() {
        let s = SharedStore::new(2, 1000);
        s.set("a", SharedValue::Str("x".into()), None).unwrap();
        s.set("b", SharedValue::Bool(true), Some(Duration::from_millis(1)))
            .unwrap();
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(s.get("b"), None, "expired");
        assert_eq!(s.incr("n", 2, None), Ok(2));
        assert_eq!(s.incr("n", 3, None), Ok(5));
        s.set("c", SharedValue::Int(1), None).unwrap();
        assert!(s.len() <= 2, "bounded");
        assert!(s.incr("c", 1, None).is_ok());
        s.set("s", SharedValue::Str("x".into()), None).unwrap();
        assert!(s.incr("s", 1, None).is_err());
        assert!(s.delete("s"));
        assert_eq!(s.get("s"), None);
    }

    #[test]
    fn bounded_in_bytes() {
        let s = SharedStore::new(100, 100);
        // Too large for the whole store: refused, nothing evicted.
        s.set("keep", SharedValue::Int(1), None).unwrap();
        let e = s
            .set("big", SharedValue::Str("x".repeat(100)), None)
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "usher.shared: \"big\" and its value take 103 bytes, more than the whole store may hold (hooks.shared_max_bytes: 100)"
        );
        assert_eq!((s.get("keep"), s.bytes()), (Some(SharedValue::Int(1)), 12));
        // What fits evicts the least recently used until within bounds.
        for i in 0..10 {
            s.set(&format!("k{i}"), SharedValue::Str("y".repeat(30)), None)
                .unwrap();
            assert!(s.bytes() <= 100, "{}", s.bytes());
        }
        assert_eq!(s.get("keep"), None);
        assert_eq!(s.len(), 3);
        assert_eq!(s.bytes(), 3 * 32);
        // Replacing and deleting give the bytes back.
        s.set("k9", SharedValue::Bool(true), None).unwrap();
        assert_eq!(s.bytes(), 2 * 32 + 10);
        assert!(s.delete("k9"));
        assert_eq!(s.bytes(), 2 * 32);
        assert_eq!(s.incr("n", 5, None), Ok(5));
        assert_eq!(s.bytes(), 2 * 32 + 9);
    }
}
