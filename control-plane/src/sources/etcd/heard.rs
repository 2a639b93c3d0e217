//! When each watch stream was last heard from, and up to which revision: how a pass tells a
//! quiet watch from a stalled one. Pure: time and etcd's answers are arguments.
//!
//! A stream silent past [`WatchHealth::silent_after`] (no event, no progress answer) is
//! checked against the member: does it hold a write under the stream's prefix newer than the
//! stream's revision? No: the keyspace is quiet (some etcd releases skip progress answers, and
//! none answers a watch starting past the newest revision until the next write). Yes: the
//! stream may only be slow to deliver it, so it is a suspect; still silent with a newer write
//! at the next check, it is stalled, and the pass ends. A member that does not answer the
//! check in time is frozen or cut off (`require_leader`), and the pass ends too.
//!
//! A deleted key is not there to read, so the check also compares the prefix's key count now
//! with its count at the stream's revision ([`super::writes_after`]): a delete the stream has not
//! delivered shows as a count unlike it.

use std::time::{Duration, Instant};

use super::Checked;

/// How a pass tells a stalled watch from a quiet one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WatchHealth {
    /// How often each watch stream is asked for its progress, and silent ones checked.
    pub progress_every: Duration,
    /// A stream not heard from (an event or a progress answer) for this long is checked.
    pub silent_after: Duration,
    /// How long the member has to answer a check.
    pub confirm_within: Duration,
}

impl Default for WatchHealth {
    fn default() -> Self {
        Self {
            progress_every: Duration::from_secs(10),
            silent_after: Duration::from_secs(25),
            confirm_within: Duration::from_secs(5),
        }
    }
}

/// What a check of a silent stream found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// No write it lacks: heard from as of now.
    Quiet,
    /// A newer write it has not delivered, perhaps on its way: checked again next time.
    Suspect,
    /// A newer write it still has not delivered, a whole check later.
    Stalled,
}

#[derive(Clone, Copy, Debug)]
struct Stream {
    at: Instant,
    /// Every write under the prefix up to this revision has reached the pass.
    revision: i64,
    suspect: bool,
}

#[derive(Debug)]
pub struct Heard(Vec<Stream>);

impl Heard {
    /// `streams` streams that start after a listing at `revision`, at `now`.
    pub fn new(streams: usize, revision: i64, now: Instant) -> Self {
        Self(vec![Stream { at: now, revision, suspect: false }; streams])
    }

    /// Stream `index` answered at `now`, delivering writes up to `revision` (its events', or
    /// a progress answer's).
    pub fn from(&mut self, index: usize, revision: i64, now: Instant) {
        if let Some(stream) = self.0.get_mut(index) {
            *stream = Stream { at: now, revision: stream.revision.max(revision), suspect: false };
        }
    }

    /// The streams unheard for `after` or longer, with the revision each has delivered.
    pub fn silent(&self, now: Instant, after: Duration) -> Vec<(usize, i64)> {
        let silent = |(_, stream): &(usize, &Stream)| now.saturating_duration_since(stream.at) >= after;
        self.0.iter().enumerate().filter(silent).map(|(index, stream)| (index, stream.revision)).collect()
    }

    /// Stream `index` was checked at `now`: whether the member holds newer writes under its
    /// prefix than it delivered, as of the revision the check read at. Quiet, the stream has
    /// every write up to that revision: its next check reads there, not at a revision etcd
    /// may have compacted since (which would fail the check, and end the pass, for a prefix
    /// merely quiet for long).
    pub fn checked(&mut self, index: usize, checked: Checked, now: Instant) -> Verdict {
        let Some(stream) = self.0.get_mut(index) else { return Verdict::Quiet };
        match (checked.changed, stream.suspect) {
            (false, _) => {
                *stream = Stream { at: now, revision: stream.revision.max(checked.at), suspect: false };
                Verdict::Quiet
            }
            (true, false) => {
                stream.suspect = true;
                Verdict::Suspect
            }
            (true, true) => Verdict::Stalled,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stream_unheard_for_the_deadline_is_silent() {
        let t0 = Instant::now();
        let mut heard = Heard::new(2, 7, t0);
        let after = Duration::from_secs(25);
        heard.from(0, 9, t0 + Duration::from_secs(20));
        assert!(heard.silent(t0 + Duration::from_secs(24), after).is_empty());
        assert_eq!(heard.silent(t0 + after, after), [(1, 7)], "the second stream was never heard from again");
        heard.from(1, 8, t0 + Duration::from_secs(30));
        assert!(heard.silent(t0 + Duration::from_secs(44), after).is_empty());
        assert_eq!(heard.silent(t0 + Duration::from_secs(45), after), [(0, 9)], "now the first");
    }

    #[test]
    fn a_silent_stream_is_quiet_without_newer_writes_and_stalled_when_one_stays_undelivered() {
        let t0 = Instant::now();
        let after = Duration::from_secs(25);
        let mut heard = Heard::new(2, 7, t0);
        let first_check = t0 + after;
        let quiet = |at| Checked { changed: false, at };
        let newer = |at| Checked { changed: true, at };
        // Nothing newer under either prefix as of revision 9: quiet, and heard from as of the
        // check, with every write up to the revision it read at.
        assert_eq!(heard.checked(0, quiet(9), first_check), Verdict::Quiet);
        assert_eq!(heard.silent(first_check, after), [(1, 7)]);
        // A newer write: perhaps on its way. Delivered before the next check, all is well.
        assert_eq!(heard.checked(1, newer(11), first_check), Verdict::Suspect);
        heard.from(1, 12, first_check + Duration::from_secs(1));
        let later = first_check + Duration::from_secs(1) + after;
        assert_eq!(
            heard.silent(later, after),
            [(0, 9), (1, 12)],
            "each is checked at what it has, a quiet one's check's"
        );
        assert_eq!(heard.checked(1, newer(14), later), Verdict::Suspect, "an answer cleared the suspicion");
        // Still silent, still behind, a check later: stalled.
        assert_eq!(heard.checked(1, newer(14), later + Duration::from_secs(10)), Verdict::Stalled);
        // Neither a progress answer nor a quiet check moves a stream's revision back.
        heard.from(0, 3, later);
        assert_eq!(heard.checked(0, quiet(5), later), Verdict::Quiet);
        assert_eq!(heard.silent(later + after, after)[0], (0, 9));
    }
}
