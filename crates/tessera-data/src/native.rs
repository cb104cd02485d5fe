//! What the collections held native share ([`tessera_engine::Native`]: a
//! large set's or hash's table, a large list's deque, in the engine's
//! memory behind a stub that holds the typed header and a marker): reaching
//! the value from an open collection, and changing it where it lies in one
//! engine lookup.

use bytes::Bytes;
use tessera_engine::{Engine, Native};

use crate::collection::corrupt;
use crate::typed::{decode_header, Edit, Kind};
use crate::{DataError, DataResult};

fn downcast<N: Native>(native: &dyn Native) -> DataResult<&N> {
    (native as &dyn std::any::Any).downcast_ref().ok_or_else(corrupt)
}

fn downcast_mut<N: Native>(native: &mut dyn Native) -> DataResult<&mut N> {
    (native as &mut dyn std::any::Any).downcast_mut().ok_or_else(corrupt)
}

/// Where the native value of an open collection is.
pub enum Held<N> {
    /// In the engine, attached at the key: each operation reaches it there
    /// and changes it at once.
    Attached,
    /// Built by this change (an inline value outgrown), stored by `store`.
    Built(Box<N>),
}

impl<N: Native + Default> Held<N> {
    /// Runs `read` on the value. A reader holds no lock of the key: a value
    /// deleted since it was opened reads as empty, as it now is.
    pub fn read<T>(&self, engine: &dyn Engine, key: &[u8], read: impl FnOnce(&N) -> T) -> DataResult<T> {
        match self {
            Held::Built(value) => Ok(read(value)),
            Held::Attached => {
                let (mut read, mut answer) = (Some(read), None);
                engine.with_native(key, &mut |found| {
                    let read = read.take().expect("called once");
                    answer = Some(match found.and_then(|(_, native)| downcast(native).ok()) {
                        Some(value) => read(value),
                        None => read(&N::default()),
                    });
                })?;
                Ok(answer.expect("called"))
            }
        }
    }

    /// Runs `write` on the value, which answers and says whether it changed
    /// the value. The caller holds the key's lock.
    pub fn write<T>(
        &mut self,
        engine: &dyn Engine,
        key: &[u8],
        write: impl FnOnce(&mut N) -> (T, bool),
    ) -> DataResult<T> {
        match self {
            Held::Built(value) => Ok(write(value).0),
            Held::Attached => {
                let (mut write, mut answer) = (Some(write), Err(corrupt()));
                engine.with_native_mut(key, &mut |found| {
                    let Some((_, native)) = found else { return false };
                    answer = downcast_mut(native).map(|value| write.take().expect("called once")(value));
                    answer.as_ref().is_ok_and(|(_, changed)| *changed)
                })?;
                Ok(answer?.0)
            }
        }
    }

    /// Ends a change of the value, which holds `len` entries: an emptied
    /// value is deleted (as Redis deletes an emptied collection), a built
    /// one stored behind its stub; an attached one is stored already.
    pub fn commit(
        self,
        engine: &dyn Engine,
        key: &[u8],
        len: u64,
        stub: impl FnOnce() -> Bytes,
    ) -> DataResult<()> {
        if len == 0 {
            engine.delete(key)?;
            return Ok(());
        }
        match self {
            Held::Attached => Ok(()),
            Held::Built(value) => Ok(engine.put_native(key, stub(), value)?),
        }
    }
}

/// Runs `edit` on the native value at `key` where it lies, if the live
/// value there is one (of `kind`: `WRONGTYPE` otherwise), in one engine
/// lookup; `None` when it is not, or when `edit` declined.
pub fn edit_native<N: Native, T>(
    engine: &dyn Engine,
    key: &[u8],
    kind: Kind,
    now_ms: u64,
    edit: impl FnOnce(&mut N) -> Edit<T>,
) -> DataResult<Option<T>> {
    if !engine.keeps_native() {
        return Ok(None);
    }
    let mut edit = Some(edit);
    let mut outcome = Ok(Edit::Declined);
    engine.with_native_mut(key, &mut |found| {
        let Some((stub, native)) = found else { return false };
        outcome = (|| {
            let (stored_kind, deadline, _) = decode_header(stub)?;
            if deadline.is_some_and(|deadline| deadline <= now_ms) {
                return Ok(Edit::Declined);
            }
            if stored_kind != kind {
                return Err(DataError::WrongType);
            }
            Ok(edit.take().expect("called once")(downcast_mut(native)?))
        })();
        matches!(outcome, Ok(Edit::Changed(_)))
    })?;
    match outcome? {
        Edit::Declined => Ok(None),
        Edit::Unchanged(answer) | Edit::Changed(answer) => Ok(Some(answer)),
    }
}
