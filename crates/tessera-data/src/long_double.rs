//! INCRBYFLOAT's arithmetic, as Redis does it: in the x87 80-bit extended
//! format (Redis's `long double` on x86-64), printed with 17 decimals and
//! the trailing zeros cut. Doing it in `f64` instead answers `0.1 + 0.2` with
//! `0.30000000000000004` where Redis answers `0.3`.

use num_bigint::BigUint;
use rustc_apfloat::ieee::X87DoubleExtended;
use rustc_apfloat::{Float, Round, Status};

use crate::{DataError, DataResult};

/// Digits after the point in Redis's "human" long double format.
const DECIMALS: u32 = 17;

#[derive(Clone, Copy, Debug)]
pub struct LongDouble(X87DoubleExtended);

fn not_a_float() -> DataError {
    DataError::Invalid("value is not a valid float".into())
}

impl LongDouble {
    /// Parses a decimal as Redis's `string2ld` accepts it: no spaces around it,
    /// `inf` / `infinity` in any case with a sign, never NaN, and nothing that
    /// overflows or underflows to zero.
    pub fn parse(text: &[u8]) -> DataResult<Self> {
        let text = std::str::from_utf8(text).map_err(|_| not_a_float())?;
        let unsigned = text.strip_prefix(['+', '-']).unwrap_or(text);
        if unsigned.eq_ignore_ascii_case("inf") || unsigned.eq_ignore_ascii_case("infinity") {
            let infinity = X87DoubleExtended::INFINITY;
            return Ok(Self(if text.starts_with('-') { -infinity } else { infinity }));
        }
        let decimal = !unsigned.is_empty()
            && unsigned.bytes().all(|byte| byte.is_ascii_digit() || b".eE+-".contains(&byte))
            && unsigned.bytes().next().is_some_and(|byte| byte.is_ascii_digit() || byte == b'.');
        if !decimal {
            return Err(not_a_float());
        }
        let parsed =
            X87DoubleExtended::from_str_r(text, Round::NearestTiesToEven).map_err(|_| not_a_float())?;
        let overflowed = parsed.status.intersects(Status::OVERFLOW);
        let vanished = parsed.status.intersects(Status::UNDERFLOW) && parsed.value.is_zero();
        if overflowed || vanished {
            return Err(not_a_float());
        }
        Ok(Self(parsed.value))
    }

    pub fn is_finite(self) -> bool {
        !self.0.is_nan() && !self.0.is_infinite()
    }

    /// The sum, or Redis's error when it is not a finite number.
    pub fn checked_add(self, other: Self) -> DataResult<Self> {
        let sum = (self.0 + other.0).value;
        if sum.is_nan() || sum.is_infinite() {
            return Err(DataError::Invalid("increment would produce NaN or Infinity".into()));
        }
        Ok(Self(sum))
    }

    /// `%.17Lf` with the trailing zeros (and a bare point) removed, `-0` as `0`.
    pub fn to_human(self) -> String {
        let bits = self.0.to_bits();
        let negative = (bits >> 79) & 1 == 1;
        let exponent_field = ((bits >> 64) & 0x7fff) as i64;
        let significand = bits as u64;
        // value = significand × 2^shift (a denormal's exponent field reads as 1).
        let shift = exponent_field.max(1) - 16383 - 63;
        let scaled = BigUint::from(significand) * BigUint::from(10u32).pow(DECIMALS);
        let units = if shift >= 0 {
            scaled << shift as u64
        } else {
            round_half_even_shift(scaled, shift.unsigned_abs())
        };
        let mut digits = units.to_string();
        if digits.len() <= DECIMALS as usize {
            digits.insert_str(0, &"0".repeat(DECIMALS as usize + 1 - digits.len()));
        }
        digits.insert(digits.len() - DECIMALS as usize, '.');
        let trimmed = digits.trim_end_matches('0').trim_end_matches('.');
        if !negative || trimmed == "0" {
            trimmed.to_string()
        } else {
            format!("-{trimmed}")
        }
    }
}

/// `value / 2^shift`, rounded to the nearest integer, ties to even (as
/// printf rounds the exact binary value).
fn round_half_even_shift(value: BigUint, shift: u64) -> BigUint {
    let quotient = &value >> shift;
    let remainder = value - (&quotient << shift);
    let half = BigUint::from(1u32) << (shift - 1);
    if remainder > half || (remainder == half && quotient.bit(0)) {
        quotient + 1u32
    } else {
        quotient
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sum(a: &str, b: &str) -> String {
        LongDouble::parse(a.as_bytes())
            .unwrap()
            .checked_add(LongDouble::parse(b.as_bytes()).unwrap())
            .unwrap()
            .to_human()
    }

    /// Replies Redis 7 gives on x86-64.
    #[test]
    fn sums_print_as_redis_prints_them() {
        assert_eq!(sum("10.50", "0.1"), "10.6");
        assert_eq!(sum("0.1", "0.2"), "0.3");
        assert_eq!(sum("5.0e3", "2.0e2"), "5200");
        assert_eq!(sum("3", "-3"), "0");
        assert_eq!(sum("-0", "0"), "0");
        assert_eq!(sum("1", "-1.5"), "-0.5");
        assert_eq!(sum("0", "1e-20"), "0");
        assert_eq!(sum("0", "1e20"), "100000000000000000000");
        assert_eq!(sum("0", "0.000001"), "0.000001");
    }

    #[test]
    fn bad_floats_and_infinite_sums_are_refused() {
        for bad in ["", " 1", "1 ", "abc", "nan", "1e99999", "1e-99999", "0x10", "--1", "1.2.3"] {
            assert!(LongDouble::parse(bad.as_bytes()).is_err(), "{bad}");
        }
        let infinity = LongDouble::parse(b"+INF").unwrap();
        assert!(infinity.checked_add(LongDouble::parse(b"1").unwrap()).is_err());
    }
}
