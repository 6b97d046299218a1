//! Pinning (transaction mode): statements that leave state on the server
//! connection keep it with the client; a pin slot first, or a refusal.

use super::*;

impl Flow {
    /// What a Bind of a statement whose text pins pins (all such
    /// statements' kinds if its names are not in the head usher saw).
    pub(super) fn bind_pins(&self, body: &[u8]) -> Option<PinKinds> {
        let pins = match prepared::bind_names(body) {
            Some((_, name, _)) => self
                .pinning_statements
                .iter()
                .filter(|(n, _)| n == name)
                .fold(PinKinds::NONE, |all, (_, k)| all | *k),
            None => self
                .pinning_statements
                .iter()
                .fold(PinKinds::NONE, |all, (_, k)| all | *k),
        };
        (!pins.is_empty()).then_some(pins)
    }

    /// Whether a Query, Parse or Bind with these effects may go out.
    pub(super) fn gate(&mut self, tag: u8, effects: &Effects) -> Gate {
        // What the scan recognised; state left by a text it could not read
        // is found by asking the server afterwards.
        let pins = effects.pins.without(PinKinds::UNKNOWN);
        if pins.is_empty() {
            return Gate::Pass;
        }
        match self.pinning {
            Pinning::Off => Gate::Pass,
            // A Bind cannot be refused (it has no stand-in): the statement
            // it runs pins even past max_pinned.
            _ if tag == frontend::BIND => match self.refuse_next.take() {
                Some(_) => Gate::Pass,
                None if self.slot => Gate::Pass,
                None => Gate::NeedSlot,
            },
            Pinning::Error => Gate::Refuse(refused_for_pinning(pins)),
            Pinning::Auto if self.slot => Gate::Pass,
            Pinning::Auto => match self.refuse_next.take() {
                Some((max_pinned, waited)) => {
                    Gate::Refuse(no_pin_slot_error(pins, max_pinned, waited))
                }
                None => Gate::NeedSlot,
            },
        }
    }

    /// Keeps what a text may do: its settings until the session settles
    /// them, its pins until the transaction ends.
    pub(super) fn note(&mut self, effects: Effects) {
        if self.effects.resets.is_empty() && !effects.resets.is_empty() {
            self.resets_from = self.ready_seen + 1;
        }
        if self.pinning != Pinning::Off {
            self.pins_seen |= effects.pins;
            self.unpins_seen |= effects.unpins;
        }
        self.effects.add(effects);
    }

    /// The databases whose idle server connections usher closes before
    /// the messages walked go out: DROP DATABASE and the like fail while
    /// other sessions are connected (usually empty).
    pub fn take_closing(&mut self) -> Vec<String> {
        std::mem::take(&mut self.closing)
    }

    /// The session took a pin slot (before a pinning statement, or for
    /// state the server said it holds).
    pub fn slot_taken(&mut self) {
        self.slot = true;
    }

    /// The session gave its pin slot back.
    pub fn slot_given_back(&mut self) {
        self.slot = false;
    }

    /// The session holds a pin slot.
    pub fn has_slot(&self) -> bool {
        self.slot
    }

    /// No pin slot could be had for the message the flow stopped at
    /// ([`ClientStep::Pin`]; `max_pinned` of the pool, and whether the
    /// session waited for one): it is refused (53300) when walked again.
    pub fn no_pin_slot(&mut self, max_pinned: usize, waited: bool) {
        self.refuse_next = Some((max_pinned, waited));
    }

    /// The transaction is over and nothing is owed (the flow said
    /// [`ServerStep::ForwardThenRelease`]): keep the server connection,
    /// give it back, or ask the server first.
    pub fn transaction_end(&mut self) -> PinStep {
        if self.pinning == Pinning::Off {
            return PinStep::Release;
        }
        let candidates = self.pinned | self.pins_seen;
        if candidates.is_empty() {
            self.pins_seen = PinKinds::NONE;
            self.unpins_seen = PinKinds::NONE;
            return PinStep::Release;
        }
        let checkable = candidates.and(PinKinds::CHECKABLE);
        if candidates.contains(PinKinds::UNKNOWN) || self.unpins_seen.intersects(checkable) {
            return PinStep::Check;
        }
        self.pinned = candidates;
        self.pins_seen = PinKinds::NONE;
        self.unpins_seen = PinKinds::NONE;
        PinStep::Keep
    }

    /// The server said which state it holds (after [`PinStep::Check`]):
    /// that, and a LOAD (which nothing undoes), is what pins now.
    pub fn checked(&mut self, present: PinKinds) -> PinStep {
        let candidates = self.pinned | self.pins_seen;
        self.pinned = present.and(PinKinds::CHECKABLE) | candidates.and(PinKinds::LOAD);
        self.pins_seen = PinKinds::NONE;
        self.unpins_seen = PinKinds::NONE;
        if self.pinned.is_empty() {
            PinStep::Release
        } else {
            PinStep::Keep
        }
    }

    /// The state that keeps the server connection with this client.
    pub fn pinned(&self) -> PinKinds {
        self.pinned
    }

    /// State the server connection may hold for this client: what pins,
    /// and what statements since the last transaction end may have left.
    /// A connection with any goes back only after a reset.
    pub fn state_left(&self) -> PinKinds {
        if self.pinning == Pinning::Off {
            PinKinds::NONE
        } else {
            self.pinned | self.pins_seen
        }
    }
}

/// What [`Flow::gate`] decided for a Query, Parse or Bind.
pub(super) enum Gate {
    Pass,
    NeedSlot,
    Refuse(PgError),
}

/// What a client is told of a statement `pinning: error` refuses.
pub(super) fn refused_for_pinning(pins: PinKinds) -> PgError {
    PgError::error(
        sqlstate::FEATURE_NOT_SUPPORTED,
        format!(
            "{} is not supported in transaction mode: it would pin the server connection",
            pins.describe()
        ),
    )
    .with_detail("pinning is set to error for this database; the statement was not run")
    .with_hint("Use pool_mode: session for this database, or pinning: auto.")
}

/// What a client is told when `max_pinned` clients of its pool already
/// hold their server connections.
pub(super) fn no_pin_slot_error(pins: PinKinds, max_pinned: usize, waited: bool) -> PgError {
    PgError::error(
        sqlstate::TOO_MANY_CONNECTIONS,
        format!(
            "too many pinned server connections: {} would pin one more",
            pins.describe()
        ),
    )
    .with_detail(format!(
        "max_pinned ({max_pinned}) clients of this pool already hold their server connections{}; the statement was not run",
        if waited {
            " and none gave one back within query_wait_timeout"
        } else {
            " (inside a transaction usher does not wait)"
        }
    ))
    .with_hint("Raise max_pinned, end the state (UNLISTEN *, pg_advisory_unlock_all(), DISCARD ALL...), or use pool_mode: session.")
}

/// The message to send in place of a refused Query or Parse (whole body):
/// a statement that fails on the server with [`REFUSED_MARKER`] in its
/// error; a Parse keeps its name and parameter types.
pub fn refused_message(tag: u8, body: &[u8]) -> BytesMut {
    let text = format!("SELECT \"{REFUSED_MARKER}\"");
    let mut out = BytesMut::with_capacity(64 + body.len().min(256));
    out.put_u8(tag);
    out.put_u32(0);
    if tag == frontend::PARSE {
        let (name, rest) = match body.iter().position(|b| *b == 0) {
            Some(p) => (&body[..p], &body[p + 1..]),
            None => (&[][..], &[][..]),
        };
        let types = rest
            .iter()
            .position(|b| *b == 0)
            .map_or(&[][..], |p| &rest[p + 1..]);
        out.put_slice(name);
        out.put_u8(0);
        out.put_slice(text.as_bytes());
        out.put_u8(0);
        if types.len() >= 2 {
            out.put_slice(types);
        } else {
            out.put_u16(0);
        }
    } else {
        out.put_slice(text.as_bytes());
        out.put_u8(0);
    }
    let len = (out.len() - 1) as u32;
    out[1..5].copy_from_slice(&len.to_be_bytes());
    out
}
