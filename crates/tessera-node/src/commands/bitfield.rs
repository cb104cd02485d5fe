//! BITFIELD and BITFIELD_RO: integers of 1 to 64 bits at any bit offset of a
//! string, read, written and incremented with Redis's overflow rules.

use tessera_wire::Request;

use super::{is, Context};
use crate::error::{CommandError, CommandResult};
use crate::typed::{parse_i64, read_kind, write, Kind};

/// How a SET or INCRBY treats a result outside the field's range.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Overflow {
    /// Modulo 2^bits (two's complement for signed fields): the default.
    Wrap,
    /// Clamped to the field's minimum or maximum.
    Saturate,
    /// Not written; the operation answers nil.
    Fail,
}

#[derive(Clone, Copy, Debug)]
enum Action {
    Get,
    Set(i64),
    IncrBy(i64),
}

#[derive(Clone, Copy, Debug)]
struct Field {
    signed: bool,
    bits: u32,
    /// In bits from the string's first (most significant) bit.
    offset: u64,
}

impl Field {
    fn range(&self) -> (i128, i128) {
        if self.signed {
            (-(1i128 << (self.bits - 1)), (1i128 << (self.bits - 1)) - 1)
        } else {
            (0, (1i128 << self.bits) - 1)
        }
    }

    /// The field's bits in `value` (zeros past its end), as a number.
    fn read(&self, value: &[u8]) -> i128 {
        let mut raw: u64 = 0;
        for bit in self.offset..self.offset + u64::from(self.bits) {
            let byte = value.get((bit >> 3) as usize).copied().unwrap_or(0);
            raw = (raw << 1) | u64::from(byte >> (7 - (bit & 7)) & 1);
        }
        if self.signed && self.bits < 64 && raw >> (self.bits - 1) & 1 == 1 {
            i128::from(raw) - (1i128 << self.bits)
        } else if self.signed {
            i128::from(raw as i64)
        } else {
            i128::from(raw)
        }
    }

    /// Writes `number`'s low `bits` bits; `value` already reaches the field's end.
    fn write(&self, value: &mut [u8], number: i128) {
        let raw = number as u64;
        for (index, bit) in (self.offset..self.offset + u64::from(self.bits)).enumerate() {
            let on = raw >> (u64::from(self.bits) - 1 - index as u64) & 1 == 1;
            let (byte, mask) = ((bit >> 3) as usize, 0x80u8 >> (bit & 7));
            if on {
                value[byte] |= mask;
            } else {
                value[byte] &= !mask;
            }
        }
    }

    /// `number` as the field holds it under `overflow`, or `None` when it does
    /// not fit and `overflow` is FAIL.
    fn fit(&self, number: i128, overflow: Overflow) -> Option<i128> {
        let (min, max) = self.range();
        if (min..=max).contains(&number) {
            return Some(number);
        }
        match overflow {
            Overflow::Fail => None,
            Overflow::Saturate => Some(if number > max { max } else { min }),
            Overflow::Wrap => {
                let low = number.rem_euclid(1i128 << self.bits);
                Some(if self.signed && low > max { low - (1i128 << self.bits) } else { low })
            }
        }
    }
}

struct Operation {
    field: Field,
    action: Action,
    overflow: Overflow,
}

fn parse_field(request: &Request, at: usize, bulk_bytes_max: usize) -> CommandResult<Field> {
    let kind = request.arg(at);
    let bad_type = || {
        CommandError::Other(
            "Invalid bitfield type. Use something like i16 u8. Note that u64 is not supported but i64 is."
                .into(),
        )
    };
    let signed = match kind.first() {
        Some(b'i') => true,
        Some(b'u') => false,
        _ => return Err(bad_type()),
    };
    let bits = parse_i64(&kind[1..]).map_err(|_| bad_type())?;
    if bits < 1 || bits > if signed { 64 } else { 63 } {
        return Err(bad_type());
    }
    let bad_offset = || CommandError::Other("bit offset is not an integer or out of range".into());
    let text = request.arg(at + 1);
    let (text, scale) = match text.strip_prefix(b"#") {
        Some(rest) => (rest, bits),
        None => (text, 1),
    };
    let offset = parse_i64(text).ok().and_then(|offset| offset.checked_mul(scale)).ok_or_else(bad_offset)?;
    if offset < 0 || (offset >> 3) as u64 >= bulk_bytes_max as u64 {
        return Err(bad_offset());
    }
    Ok(Field { signed, bits: bits as u32, offset: offset as u64 })
}

/// Every operation, checked before any runs (Redis answers the first error
/// and changes nothing).
fn parse(request: &Request, bulk_bytes_max: usize) -> CommandResult<Vec<Operation>> {
    let mut operations = Vec::new();
    let mut overflow = Overflow::Wrap;
    let mut at = 2;
    while at < request.len() {
        let (name, remaining) = (request.arg(at), request.len() - at - 1);
        if is(name, "overflow") && remaining >= 1 {
            let kind = request.arg(at + 1);
            overflow = if is(kind, "wrap") {
                Overflow::Wrap
            } else if is(kind, "sat") {
                Overflow::Saturate
            } else if is(kind, "fail") {
                Overflow::Fail
            } else {
                return Err(CommandError::Other("Invalid OVERFLOW type specified".into()));
            };
            at += 2;
            continue;
        }
        let get = is(name, "get") && remaining >= 2;
        if !get && !((is(name, "set") || is(name, "incrby")) && remaining >= 3) {
            return Err(CommandError::Syntax);
        }
        let field = parse_field(request, at + 1, bulk_bytes_max)?;
        let action = if get {
            Action::Get
        } else {
            let number = super::integer_arg(request, at + 3)?;
            if is(name, "set") {
                Action::Set(number)
            } else {
                Action::IncrBy(number)
            }
        };
        operations.push(Operation { field, action, overflow });
        at += if get { 3 } else { 4 };
    }
    Ok(operations)
}

pub fn bitfield(context: &mut Context, request: &Request) -> CommandResult {
    run(context, request, false)
}

pub fn bitfield_ro(context: &mut Context, request: &Request) -> CommandResult {
    run(context, request, true)
}

fn run(context: &mut Context, request: &Request, read_only: bool) -> CommandResult {
    let operations = parse(request, context.bulk_bytes_max())?;
    let writes_end = operations
        .iter()
        .filter(|operation| !matches!(operation.action, Action::Get))
        .map(|operation| operation.field.offset + u64::from(operation.field.bits))
        .max();
    if read_only && writes_end.is_some() {
        return Err(CommandError::Other("BITFIELD_RO only supports the GET subcommand".into()));
    }
    let key = request.arg(1);
    let engine = context.engine(key);
    let _lock = if writes_end.is_some() { context.lock_key(key)? } else { None };
    let stored = read_kind(engine, key, Kind::String, context.now_ms)?;
    let expires_at_ms = stored.as_ref().and_then(|stored| stored.expires_at_ms);
    let mut value = stored.map(|stored| stored.payload.to_vec()).unwrap_or_default();
    // As in Redis, a write grows the string to its farthest field first,
    // even when every write then fails its overflow check.
    if let Some(end) = writes_end {
        value.resize(value.len().max(end.div_ceil(8) as usize), 0);
    }
    context.out.array(operations.len());
    for Operation { field, action, overflow } in operations {
        let current = field.read(&value);
        let (stored, reply) = match action {
            Action::Get => (None, Some(current)),
            Action::Set(number) => {
                // An unsigned field reads its argument as the 64-bit pattern
                // (SET u8 -1 overflows; under WRAP it stores 255).
                let number = if field.signed { i128::from(number) } else { i128::from(number as u64) };
                let fitted = field.fit(number, overflow);
                (fitted, fitted.map(|_| current))
            }
            Action::IncrBy(delta) => {
                let fitted = field.fit(current + i128::from(delta), overflow);
                (fitted, fitted)
            }
        };
        if let Some(number) = stored {
            field.write(&mut value, number);
        }
        match reply {
            Some(number) => context.out.integer(number as i64),
            None => context.out.null(),
        }
    }
    if writes_end.is_some() {
        write(engine, key, Kind::String, expires_at_ms, &value, usize::MAX)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field(signed: bool, bits: u32, offset: u64) -> Field {
        Field { signed, bits, offset }
    }

    #[test]
    fn fields_read_back_what_they_wrote_at_any_alignment() {
        for (signed, bits) in [(true, 1), (true, 5), (false, 7), (true, 64), (false, 63), (true, 13)] {
            for offset in [0, 3, 8, 61] {
                let field = field(signed, bits, offset);
                let (min, max) = field.range();
                for number in [min, max, 0, min / 3, max / 2] {
                    let mut value = vec![0xA5u8; 20];
                    let before = value.clone();
                    field.write(&mut value, number);
                    assert_eq!(field.read(&value), number, "{field:?} {number}");
                    // Bits outside the field are untouched.
                    for bit in (0..160).filter(|bit| *bit < offset || *bit >= offset + u64::from(bits)) {
                        let (byte, mask) = ((bit >> 3) as usize, 0x80u8 >> (bit & 7));
                        assert_eq!(value[byte] & mask, before[byte] & mask);
                    }
                }
            }
        }
    }

    #[test]
    fn overflow_wraps_saturates_or_fails_as_redis_does() {
        let i8_field = field(true, 8, 0);
        assert_eq!(i8_field.fit(128, Overflow::Wrap), Some(-128));
        assert_eq!(i8_field.fit(-129, Overflow::Wrap), Some(127));
        assert_eq!(i8_field.fit(300, Overflow::Saturate), Some(127));
        assert_eq!(i8_field.fit(-300, Overflow::Saturate), Some(-128));
        assert_eq!(i8_field.fit(128, Overflow::Fail), None);
        let u8_field = field(false, 8, 0);
        assert_eq!(u8_field.fit(i128::from(u64::MAX), Overflow::Wrap), Some(255));
        assert_eq!(u8_field.fit(-1, Overflow::Saturate), Some(0));
        let i64_field = field(true, 64, 0);
        assert_eq!(i64_field.fit(i128::from(i64::MAX) + 1, Overflow::Wrap), Some(i128::from(i64::MIN)));
    }
}
