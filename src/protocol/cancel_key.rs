//! The layout of the secret in the BackendKeyData usher gives clients, when
//! peering is on (`peer_id` > 0): which instance gave the key, and whether
//! a cancel request carrying it may still be forwarded.
//!
//! A key is the pid and the secret, 32 bits each. The pid cannot carry the
//! peer id: in session mode a client is told its backend's pid. So the
//! secret does, in its low bits as PgBouncer does:
//!
//! ```text
//!  31              15   14   13            0
//! [ random (17 bits) | F | peer id (14 bits) ]
//! ```
//!
//! `F` (forwardable) is set in every key a client is given and cleared in
//! the CancelRequest an instance forwards to a peer: a request that
//! arrives with `F` clear and a peer id that is not the receiver's own is
//! dropped, so a forwarded cancel is never forwarded again (no loop between
//! two instances whose lists disagree). PgBouncer keeps a two-bit TTL (up
//! to three hops); usher forwards once, so one bit is enough.
//!
//! With peering off the secret is 32 random bits. With it on, 17 are
//! random: a forged cancel (which needs the pid too) is guessed once in
//! 131,072 tries rather than once in 4 billion; docs/operations.md says so.

/// The peer id's bits.
pub const PEER_ID_MASK: u32 = 0x3FFF;
/// Set in keys given to clients; cleared in a forwarded request.
pub const FORWARDABLE: u32 = 1 << 14;

/// A secret for a new client: `random` with the layout applied when
/// `peer_id` is set (peering on), else `random` itself.
pub fn new_secret(random: u32, peer_id: u16) -> u32 {
    if peer_id == 0 {
        return random;
    }
    (random & !(PEER_ID_MASK | FORWARDABLE)) | FORWARDABLE | (u32::from(peer_id) & PEER_ID_MASK)
}

/// What a CancelRequest's secret says, for an instance with peering on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decoded {
    pub peer_id: u16,
    /// False once the request was forwarded by a peer.
    pub forwardable: bool,
}

pub fn decode(secret: u32) -> Decoded {
    Decoded {
        peer_id: (secret & PEER_ID_MASK) as u16,
        forwardable: secret & FORWARDABLE != 0,
    }
}

/// The secret as the instance that gave it stored it (forwarded requests
/// arrive with `F` cleared).
pub fn as_given(secret: u32) -> u32 {
    secret | FORWARDABLE
}

/// The secret to send in a forwarded request.
pub fn forwarded(secret: u32) -> u32 {
    secret & !FORWARDABLE
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_peer_id_and_the_flag_round_trip() {
        for (random, peer) in [(0u32, 1u16), (u32::MAX, 16_383), (0xDEAD_BEEF, 7)] {
            let s = new_secret(random, peer);
            assert_eq!(
                decode(s),
                Decoded {
                    peer_id: peer,
                    forwardable: true
                }
            );
            // The random high bits survive.
            assert_eq!(s >> 15, random >> 15);
            let f = forwarded(s);
            assert_eq!(
                decode(f),
                Decoded {
                    peer_id: peer,
                    forwardable: false
                }
            );
            assert_eq!(as_given(f), s);
        }
    }

    #[test]
    fn without_peering_the_secret_is_all_random() {
        assert_eq!(new_secret(0x1234_5678, 0), 0x1234_5678);
    }
}
