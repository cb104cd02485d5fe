//! What clients did and saw, with virtual times: the input of the checkers.

use bytes::Bytes;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Call {
    Get,
    Put(Bytes),
    Delete,
    Increment(i64),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// A get's value, or an increment's new value.
    Value(Option<Bytes>),
    /// A put or delete took effect.
    Written,
    /// No answer before the client gave up: it may or may not have taken effect.
    Unknown,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Operation {
    pub client: usize,
    pub key: Bytes,
    pub call: Call,
    pub outcome: Outcome,
    pub invoked_at: u64,
    /// `None` when the outcome is unknown.
    pub completed_at: Option<u64>,
}

impl Operation {
    pub fn is_write(&self) -> bool {
        !matches!(self.call, Call::Get)
    }
}

/// The strong operations of a run (eventual reads are not linearizable and are
/// kept apart).
#[derive(Clone, Debug, Default)]
pub struct History {
    pub operations: Vec<Operation>,
}

impl History {
    /// What a checker may demand of operations from `at` on, when the
    /// guarantee starts then with every key holding its value in `state`:
    /// that state as writes made just before `at`, then the operations still running
    /// at `at` or begun later. Of those begun earlier, reads are dropped (they
    /// were answered under the old guarantee) and increments count as unknown
    /// (their effect may be in `state` already).
    pub fn after(&self, at: u64, state: &[(Bytes, Option<Bytes>)]) -> History {
        let mut operations: Vec<Operation> = state
            .iter()
            .map(|(key, value)| Operation {
                client: usize::MAX,
                key: key.clone(),
                call: value.clone().map_or(Call::Delete, Call::Put),
                outcome: Outcome::Written,
                // An operation takes time: one that returns as it is invoked
                // would return before its own call.
                invoked_at: at.saturating_sub(1),
                completed_at: Some(at),
            })
            .collect();
        for operation in &self.operations {
            if operation.completed_at.is_some_and(|done| done <= at) {
                continue;
            }
            if operation.invoked_at >= at {
                operations.push(operation.clone());
                continue;
            }
            match operation.call {
                Call::Get => {}
                Call::Increment(_) => operations.push(Operation {
                    outcome: Outcome::Unknown,
                    completed_at: None,
                    ..operation.clone()
                }),
                _ => operations.push(operation.clone()),
            }
        }
        History { operations }
    }

    /// The operations up to `at`, when the guarantee ends then: those over
    /// by `at` as they were; writes still running as unknown; the rest dropped.
    pub fn before(&self, at: u64) -> History {
        let operations = self
            .operations
            .iter()
            .filter(|operation| operation.invoked_at < at)
            .filter_map(|operation| match operation.completed_at {
                Some(done) if done <= at => Some(operation.clone()),
                _ if operation.is_write() => {
                    Some(Operation { outcome: Outcome::Unknown, completed_at: None, ..operation.clone() })
                }
                _ => None,
            })
            .collect();
        History { operations }
    }
}

/// Reads a history recorded from real clients, one JSON object per line:
///
/// ```text
/// {"client": 3, "key": "k7", "call": "set", "value": "12", "outcome": "written", "invoked": 1042, "completed": 1390}
/// {"client": 1, "key": "k7", "call": "get", "outcome": "value", "result": "12", "invoked": 1100, "completed": 1200}
/// {"client": 2, "key": "k7", "call": "incr", "delta": 1, "outcome": "unknown", "invoked": 1300}
/// ```
///
/// `call` is get, set, del or incr; `outcome` is value (with `result`, null
/// for a missing key), written, or unknown (the client got an error or gave
/// up: the operation may or may not have taken effect, and has no
/// `completed`). Times are in any one unit, from one clock.
pub fn from_json_lines(text: &str) -> Result<History, String> {
    let mut operations = Vec::new();
    for line in json_lines(text) {
        let line = line?;
        let call = match line.field("call")?.as_str() {
            Some("get") => Call::Get,
            Some("set") => Call::Put(line.text("value")?),
            Some("del") => Call::Delete,
            Some("incr") => Call::Increment(line.integer("delta")?),
            other => return Err(line.error(format!("unknown call {other:?}"))),
        };
        let (outcome, completed_at) = match line.field("outcome")?.as_str() {
            Some("value") => (Outcome::Value(line.optional_text("result")?), Some(line.whole("completed")?)),
            Some("written") => (Outcome::Written, Some(line.whole("completed")?)),
            Some("unknown") => (Outcome::Unknown, None),
            other => return Err(line.error(format!("unknown outcome {other:?}"))),
        };
        operations.push(Operation {
            client: line.whole("client")? as usize,
            key: line.text("key")?,
            call,
            outcome,
            invoked_at: line.whole("invoked")?,
            completed_at,
        });
    }
    Ok(History { operations })
}

/// One record of a history written as JSON lines, whose fields are read
/// with errors that name the line.
pub(crate) struct JsonLine {
    number: usize,
    record: serde_json::Value,
}

/// Each record of `text`, one JSON object a line (blank lines skipped).
pub(crate) fn json_lines(text: &str) -> impl Iterator<Item = Result<JsonLine, String>> + '_ {
    text.lines().enumerate().filter(|(_, line)| !line.trim().is_empty()).map(|(index, line)| {
        let number = index + 1;
        serde_json::from_str(line)
            .map(|record| JsonLine { number, record })
            .map_err(|error| format!("line {number}: {error}"))
    })
}

impl JsonLine {
    pub(crate) fn error(&self, message: String) -> String {
        format!("line {}: {message}", self.number)
    }

    pub(crate) fn field(&self, name: &str) -> Result<&serde_json::Value, String> {
        self.record.get(name).ok_or_else(|| self.error(format!("no {name:?}")))
    }

    pub(crate) fn text(&self, name: &str) -> Result<Bytes, String> {
        let text =
            self.field(name)?.as_str().ok_or_else(|| self.error(format!("{name:?} is not a string")))?;
        Ok(Bytes::from(text.to_string()))
    }

    /// A string, or null for none.
    pub(crate) fn optional_text(&self, name: &str) -> Result<Option<Bytes>, String> {
        match self.field(name)? {
            serde_json::Value::Null => Ok(None),
            _ => self.text(name).map(Some),
        }
    }

    pub(crate) fn integer(&self, name: &str) -> Result<i64, String> {
        self.field(name)?.as_i64().ok_or_else(|| self.error(format!("{name:?} is not an integer")))
    }

    pub(crate) fn whole(&self, name: &str) -> Result<u64, String> {
        self.field(name)?.as_u64().ok_or_else(|| self.error(format!("{name:?} is not a whole number")))
    }

    pub(crate) fn flag(&self, name: &str) -> Result<bool, String> {
        self.field(name)?.as_bool().ok_or_else(|| self.error(format!("{name:?} is not a boolean")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::linearizability::{check, Verdict};

    #[test]
    fn recorded_histories_are_read_and_checked() {
        let good = r#"
{"client": 0, "key": "k", "call": "set", "value": "1", "outcome": "written", "invoked": 0, "completed": 10}
{"client": 1, "key": "k", "call": "get", "outcome": "value", "result": "1", "invoked": 20, "completed": 30}
{"client": 1, "key": "k", "call": "incr", "delta": 2, "outcome": "unknown", "invoked": 40}
{"client": 0, "key": "k", "call": "get", "outcome": "value", "result": "3", "invoked": 50, "completed": 60}
"#;
        let history = from_json_lines(good).unwrap();
        assert_eq!(history.operations.len(), 4);
        assert_eq!(check(&history), Verdict::Linearizable);
        let stale = r#"
{"client": 0, "key": "k", "call": "set", "value": "1", "outcome": "written", "invoked": 0, "completed": 10}
{"client": 1, "key": "k", "call": "get", "outcome": "value", "result": null, "invoked": 20, "completed": 30}
"#;
        assert!(matches!(check(&from_json_lines(stale).unwrap()), Verdict::Violation { .. }));
        assert!(from_json_lines(r#"{"client": 0, "key": "k", "call": "cas"}"#)
            .unwrap_err()
            .contains("line 1"));
        assert!(from_json_lines("not json").is_err());
    }
}
