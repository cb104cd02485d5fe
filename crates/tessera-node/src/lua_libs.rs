//! The libraries Redis gives its scripts beside Lua's own: `cjson` (JSON,
//! as lua-cjson 2.1 encodes and decodes it) and `bit` (LuaBitOp: 32-bit
//! operations on Lua numbers).

use mlua::{LightUserData, Lua, MultiValue, Table, Value};

/// Nesting lua-cjson allows, encoding and decoding.
const JSON_DEPTH_MAX: usize = 1000;
/// The stack of a thread that runs scripts: enough for JSON and replies
/// nested `JSON_DEPTH_MAX` deep, even in a debug build. (Reserved, not used,
/// until a script nests that deep.)
pub const SCRIPT_STACK_BYTES: usize = 64 << 20;
/// An array with holes is encoded as one while its largest index is at most
/// this, or at most twice its element count (lua-cjson's sparse rules).
const SPARSE_SAFE: usize = 10;
const SPARSE_RATIO: usize = 2;

/// `cjson.null`: a light userdata holding NULL, as lua-cjson's.
fn json_null() -> Value {
    Value::LightUserData(LightUserData(std::ptr::null_mut()))
}

fn is_json_null(value: &Value) -> bool {
    matches!(value, Value::LightUserData(data) if data.0.is_null())
}

/// Builds the `cjson` table.
pub fn cjson(lua: &Lua) -> mlua::Result<Table> {
    let table = lua.create_table()?;
    table.set(
        "encode",
        lua.create_function(|lua, args: MultiValue| {
            let value = single_argument(args, "encode")?;
            let mut out = Vec::new();
            encode(&value, 0, &mut out)?;
            lua.create_string(&out)
        })?,
    )?;
    table.set(
        "decode",
        lua.create_function(|lua, args: MultiValue| {
            let value = single_argument(args, "decode")?;
            let Some(text) = lua.coerce_string(value.clone())? else {
                return Err(mlua::Error::runtime(format!(
                    "bad argument #1 to 'decode' (string expected, got {})",
                    value.type_name()
                )));
            };
            let bytes = text.as_bytes();
            JsonParser { lua, bytes: &bytes, at: 0 }.document()
        })?,
    )?;
    table.set("null", json_null())?;
    Ok(table)
}

/// The one argument lua-cjson's functions take.
fn single_argument(args: MultiValue, function: &str) -> mlua::Result<Value> {
    if args.len() != 1 {
        return Err(mlua::Error::runtime(format!("bad argument #1 to '{function}' (expected 1 argument)")));
    }
    Ok(args.into_iter().next().expect("one argument"))
}

/// lua-cjson prints numbers with `%.14g`.
fn format_number(number: f64) -> String {
    if number == number.trunc() && number.abs() < 1e14 {
        return format!("{}", number as i64);
    }
    // %.14g: 14 significant digits, exponent form outside [1e-4, 1e14).
    let exponent = number.abs().log10().floor() as i32;
    if !(-4..14).contains(&exponent) {
        let text = format!("{:.13e}", number);
        let (mantissa, power) = text.split_once('e').expect("{:e} has an exponent");
        let mantissa = mantissa.trim_end_matches('0').trim_end_matches('.');
        let power: i32 = power.parse().expect("an integer exponent");
        return format!("{mantissa}e{}{:02}", if power < 0 { '-' } else { '+' }, power.abs());
    }
    let decimals = (13 - exponent).max(0) as usize;
    let text = format!("{number:.decimals$}");
    if text.contains('.') {
        text.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        text
    }
}

fn encode(value: &Value, depth: usize, out: &mut Vec<u8>) -> mlua::Result<()> {
    match value {
        Value::Nil => out.extend_from_slice(b"null"),
        _ if is_json_null(value) => out.extend_from_slice(b"null"),
        Value::Boolean(flag) => out.extend_from_slice(if *flag { b"true" } else { b"false" }),
        Value::Integer(number) => out.extend_from_slice(number.to_string().as_bytes()),
        Value::Number(number) => {
            if !number.is_finite() {
                return Err(mlua::Error::runtime("Cannot serialise number: must not be NaN or Inf"));
            }
            out.extend_from_slice(format_number(*number).as_bytes());
        }
        Value::String(text) => encode_string(&text.as_bytes(), out),
        Value::Table(table) => {
            if depth >= JSON_DEPTH_MAX {
                return Err(mlua::Error::runtime(format!(
                    "Cannot serialise, excessive nesting ({})",
                    depth + 1
                )));
            }
            match array_length(table)? {
                Some(length) => {
                    out.push(b'[');
                    for index in 1..=length {
                        if index > 1 {
                            out.push(b',');
                        }
                        encode(&table.raw_get::<Value>(index)?, depth + 1, out)?;
                    }
                    out.push(b']');
                }
                None => {
                    out.push(b'{');
                    let mut first = true;
                    for pair in table.clone().pairs::<Value, Value>() {
                        let (key, item) = pair?;
                        if !first {
                            out.push(b',');
                        }
                        first = false;
                        match &key {
                            Value::String(text) => encode_string(&text.as_bytes(), out),
                            Value::Integer(number) => encode_string(number.to_string().as_bytes(), out),
                            Value::Number(number) => encode_string(format_number(*number).as_bytes(), out),
                            _ => {
                                return Err(mlua::Error::runtime(
                                    "Cannot serialise table: table key must be a number or string",
                                ))
                            }
                        }
                        out.push(b':');
                        encode(&item, depth + 1, out)?;
                    }
                    out.push(b'}');
                }
            }
        }
        other => {
            return Err(mlua::Error::runtime(format!(
                "Cannot serialise {}: type not supported",
                other.type_name()
            )))
        }
    }
    Ok(())
}

/// The length of a table that encodes as an array: every key a positive
/// integer, not too sparse. None: an object (an empty table is one).
fn array_length(table: &Table) -> mlua::Result<Option<usize>> {
    let mut largest = 0usize;
    let mut count = 0usize;
    for pair in table.clone().pairs::<Value, Value>() {
        let (key, _) = pair?;
        let index = match key {
            Value::Integer(index) if index >= 1 => index as usize,
            Value::Number(index) if index >= 1.0 && index == index.floor() && index < 1e15 => index as usize,
            _ => return Ok(None),
        };
        largest = largest.max(index);
        count += 1;
    }
    if largest > SPARSE_SAFE && largest > count * SPARSE_RATIO {
        return Err(mlua::Error::runtime("Cannot serialise table: excessively sparse array"));
    }
    Ok((count > 0).then_some(largest))
}

fn encode_string(bytes: &[u8], out: &mut Vec<u8>) {
    out.push(b'"');
    for &byte in bytes {
        match byte {
            b'"' => out.extend_from_slice(b"\\\""),
            b'\\' => out.extend_from_slice(b"\\\\"),
            b'/' => out.extend_from_slice(b"\\/"),
            b'\n' => out.extend_from_slice(b"\\n"),
            b'\r' => out.extend_from_slice(b"\\r"),
            b'\t' => out.extend_from_slice(b"\\t"),
            0x08 => out.extend_from_slice(b"\\b"),
            0x0c => out.extend_from_slice(b"\\f"),
            0..=0x1f | 0x7f => out.extend_from_slice(format!("\\u{byte:04x}").as_bytes()),
            _ => out.push(byte),
        }
    }
    out.push(b'"');
}

/// A token of JSON text, as lua-cjson's tokenizer names them (its error
/// messages name the token found).
#[derive(Clone, Debug, PartialEq)]
enum Token {
    ObjectBegin,
    ObjectEnd,
    ArrayBegin,
    ArrayEnd,
    Colon,
    Comma,
    String(Vec<u8>),
    Number(f64),
    Boolean(bool),
    Null,
    End,
    /// What is wrong, in lua-cjson's words.
    Invalid(&'static str),
}

impl Token {
    fn name(&self) -> &'static str {
        match self {
            Token::ObjectBegin => "T_OBJ_BEGIN",
            Token::ObjectEnd => "T_OBJ_END",
            Token::ArrayBegin => "T_ARR_BEGIN",
            Token::ArrayEnd => "T_ARR_END",
            Token::Colon => "T_COLON",
            Token::Comma => "T_COMMA",
            Token::String(_) => "T_STRING",
            Token::Number(_) => "T_NUMBER",
            Token::Boolean(_) => "T_BOOLEAN",
            Token::Null => "T_NULL",
            Token::End => "T_END",
            Token::Invalid(what) => what,
        }
    }
}

struct JsonParser<'l, 'b> {
    lua: &'l Lua,
    bytes: &'b [u8],
    at: usize,
}

impl JsonParser<'_, '_> {
    /// The next token and the index it starts at.
    fn next(&mut self) -> (Token, usize) {
        while self.bytes.get(self.at).is_some_and(|byte| matches!(byte, b' ' | b'\t' | b'\n' | b'\r')) {
            self.at += 1;
        }
        let start = self.at;
        let Some(&byte) = self.bytes.get(self.at) else { return (Token::End, start) };
        let single = match byte {
            b'{' => Some(Token::ObjectBegin),
            b'}' => Some(Token::ObjectEnd),
            b'[' => Some(Token::ArrayBegin),
            b']' => Some(Token::ArrayEnd),
            b':' => Some(Token::Colon),
            b',' => Some(Token::Comma),
            _ => None,
        };
        if let Some(token) = single {
            self.at += 1;
            return (token, start);
        }
        let token = match byte {
            b'"' => self.string(),
            b'-' | b'0'..=b'9' => self.number(),
            b't' => self.literal(b"true", Token::Boolean(true)),
            b'f' => self.literal(b"false", Token::Boolean(false)),
            b'n' => self.literal(b"null", Token::Null),
            _ => Token::Invalid("invalid token"),
        };
        (token, start)
    }

    fn literal(&mut self, word: &[u8], token: Token) -> Token {
        if self.bytes[self.at..].starts_with(word) {
            self.at += word.len();
            token
        } else {
            Token::Invalid("invalid token")
        }
    }

    fn number(&mut self) -> Token {
        let rest = &self.bytes[self.at..];
        let digits = rest.strip_prefix(b"-").unwrap_or(rest);
        // lua-cjson refuses hex and leading zeros that strtod would read.
        if digits.len() > 1 && digits[0] == b'0' && (digits[1].is_ascii_digit() || digits[1] | 0x20 == b'x') {
            return Token::Invalid("invalid number");
        }
        let mut end = rest.len() - digits.len();
        let mut seen_digit = false;
        while rest.get(end).is_some_and(u8::is_ascii_digit) {
            end += 1;
            seen_digit = true;
        }
        if rest.get(end) == Some(&b'.') {
            end += 1;
            while rest.get(end).is_some_and(u8::is_ascii_digit) {
                end += 1;
                seen_digit = true;
            }
        }
        if seen_digit && rest.get(end).is_some_and(|byte| byte | 0x20 == b'e') {
            let mut exponent = end + 1;
            if rest.get(exponent).is_some_and(|byte| matches!(byte, b'+' | b'-')) {
                exponent += 1;
            }
            if rest.get(exponent).is_some_and(u8::is_ascii_digit) {
                end = exponent;
                while rest.get(end).is_some_and(u8::is_ascii_digit) {
                    end += 1;
                }
            }
        }
        let number = std::str::from_utf8(&rest[..end]).ok().and_then(|text| text.parse::<f64>().ok());
        match number {
            Some(number) if seen_digit => {
                self.at += end;
                Token::Number(number)
            }
            _ => Token::Invalid("invalid number"),
        }
    }

    fn string(&mut self) -> Token {
        self.at += 1; // the opening quote
        let mut text = Vec::new();
        loop {
            let Some(&byte) = self.bytes.get(self.at) else {
                return Token::Invalid("unexpected end of string");
            };
            self.at += 1;
            match byte {
                b'"' => return Token::String(text),
                b'\\' => {
                    let Some(&escaped) = self.bytes.get(self.at) else {
                        return Token::Invalid("unexpected end of string");
                    };
                    self.at += 1;
                    match escaped {
                        b'"' | b'\\' | b'/' => text.push(escaped),
                        b'b' => text.push(0x08),
                        b'f' => text.push(0x0c),
                        b'n' => text.push(b'\n'),
                        b'r' => text.push(b'\r'),
                        b't' => text.push(b'\t'),
                        b'u' => match self.unicode_escape() {
                            Some(character) => {
                                text.extend_from_slice(character.encode_utf8(&mut [0; 4]).as_bytes())
                            }
                            None => return Token::Invalid("invalid unicode escape code"),
                        },
                        _ => return Token::Invalid("invalid escape code"),
                    }
                }
                _ => text.push(byte),
            }
        }
    }

    /// The character a `\u` escape (and a low surrogate after it) names.
    fn unicode_escape(&mut self) -> Option<char> {
        let code = self.hex4()?;
        if !(0xd800..0xdc00).contains(&code) {
            return char::from_u32(code);
        }
        if !self.bytes[self.at..].starts_with(b"\\u") {
            return None;
        }
        self.at += 2;
        let low = self.hex4()?;
        if !(0xdc00..0xe000).contains(&low) {
            return None;
        }
        char::from_u32(0x10000 + ((code - 0xd800) << 10) + (low - 0xdc00))
    }

    fn hex4(&mut self) -> Option<u32> {
        let digits = self.bytes.get(self.at..self.at + 4)?;
        let code = u32::from_str_radix(std::str::from_utf8(digits).ok()?, 16).ok()?;
        self.at += 4;
        Some(code)
    }

    fn error(expected: &str, (token, at): &(Token, usize)) -> mlua::Error {
        mlua::Error::runtime(format!(
            "Expected {expected} but found {} at character {}",
            token.name(),
            at + 1
        ))
    }

    /// The whole text as one value.
    fn document(&mut self) -> mlua::Result<Value> {
        let first = self.next();
        let value = self.value(first, 0)?;
        match self.next() {
            (Token::End, _) => Ok(value),
            other => Err(Self::error("the end", &other)),
        }
    }

    fn value(&mut self, token: (Token, usize), depth: usize) -> mlua::Result<Value> {
        let (kind, at) = &token;
        if matches!(kind, Token::ObjectBegin | Token::ArrayBegin) && depth >= JSON_DEPTH_MAX {
            return Err(mlua::Error::runtime(format!(
                "Found too many nested data structures ({}) at character {}",
                depth + 1,
                at + 1
            )));
        }
        match kind {
            Token::ObjectBegin => self.object(depth + 1),
            Token::ArrayBegin => self.array(depth + 1),
            Token::String(text) => Ok(Value::String(self.lua.create_string(text)?)),
            Token::Number(number) => Ok(Value::Number(*number)),
            Token::Boolean(flag) => Ok(Value::Boolean(*flag)),
            Token::Null => Ok(json_null()),
            _ => Err(Self::error("value", &token)),
        }
    }

    fn array(&mut self, depth: usize) -> mlua::Result<Value> {
        let table = self.lua.create_table()?;
        let mut token = self.next();
        if token.0 == Token::ArrayEnd {
            return Ok(Value::Table(table));
        }
        for index in 1.. {
            table.raw_set(index, self.value(token, depth)?)?;
            match self.next() {
                (Token::ArrayEnd, _) => break,
                (Token::Comma, _) => token = self.next(),
                other => return Err(Self::error("comma or array end", &other)),
            }
        }
        Ok(Value::Table(table))
    }

    fn object(&mut self, depth: usize) -> mlua::Result<Value> {
        let table = self.lua.create_table()?;
        let mut token = self.next();
        if token.0 == Token::ObjectEnd {
            return Ok(Value::Table(table));
        }
        loop {
            let Token::String(key) = &token.0 else { return Err(Self::error("object key string", &token)) };
            let key = self.lua.create_string(key)?;
            match self.next() {
                (Token::Colon, _) => {}
                other => return Err(Self::error("colon", &other)),
            }
            let value_token = self.next();
            table.raw_set(key, self.value(value_token, depth)?)?;
            match self.next() {
                (Token::ObjectEnd, _) => return Ok(Value::Table(table)),
                (Token::Comma, _) => token = self.next(),
                other => return Err(Self::error("comma or object end", &other)),
            }
        }
    }
}

/// A Lua number as LuaBitOp reads it: rounded to an integer, modulo 2^32.
/// `position` and `name` are for the error, which says what LuaBitOp says.
fn to_bit(value: &Value, position: usize, name: &str) -> mlua::Result<i32> {
    let number = match value {
        Value::Integer(number) => Some(*number as f64),
        Value::Number(number) => Some(*number),
        Value::String(text) => text.to_str().ok().and_then(|text| text.trim().parse::<f64>().ok()),
        _ => None,
    };
    let Some(number) = number else {
        let got = if matches!(value, Value::Nil) { "no value" } else { value.type_name() };
        return Err(mlua::Error::runtime(format!(
            "bad argument #{position} to '{name}' (number expected, got {got})"
        )));
    };
    Ok(number.round_ties_even().rem_euclid(4_294_967_296.0) as u64 as u32 as i32)
}

/// Builds the `bit` table.
pub fn bit(lua: &Lua) -> mlua::Result<Table> {
    let table = lua.create_table()?;
    let fold = |name: &'static str, operation: fn(i32, i32) -> i32| -> mlua::Result<()> {
        table.set(
            name,
            lua.create_function(move |_, args: MultiValue| {
                let mut result = to_bit(args.front().unwrap_or(&Value::Nil), 1, name)?;
                for (index, value) in args.iter().enumerate().skip(1) {
                    result = operation(result, to_bit(value, index + 1, name)?);
                }
                Ok(result as f64)
            })?,
        )
    };
    fold("band", |a, b| a & b)?;
    fold("bor", |a, b| a | b)?;
    fold("bxor", |a, b| a ^ b)?;
    let unary = |name: &'static str, operation: fn(i32) -> i32| -> mlua::Result<()> {
        table.set(
            name,
            lua.create_function(move |_, value: Value| Ok(operation(to_bit(&value, 1, name)?) as f64))?,
        )
    };
    unary("tobit", |value| value)?;
    unary("bnot", |value| !value)?;
    unary("bswap", i32::swap_bytes)?;
    let shift = |name: &'static str, operation: fn(i32, u32) -> i32| -> mlua::Result<()> {
        table.set(
            name,
            lua.create_function(move |_, (value, count): (Value, Value)| {
                Ok(operation(to_bit(&value, 1, name)?, (to_bit(&count, 2, name)? & 31) as u32) as f64)
            })?,
        )
    };
    shift("lshift", |value, count| ((value as u32) << count) as i32)?;
    shift("rshift", |value, count| ((value as u32) >> count) as i32)?;
    shift("arshift", |value, count| value >> count)?;
    shift("rol", |value, count| (value as u32).rotate_left(count) as i32)?;
    shift("ror", |value, count| (value as u32).rotate_right(count) as i32)?;
    table.set(
        "tohex",
        lua.create_function(|_, (value, digits): (Value, Option<Value>)| {
            let value = to_bit(&value, 1, "tohex")? as u32;
            let digits = match &digits {
                Some(digits) => to_bit(digits, 2, "tohex")?,
                None => 8,
            };
            let width = digits.unsigned_abs().min(8) as usize;
            let text = if digits < 0 { format!("{value:08X}") } else { format!("{value:08x}") };
            Ok(text[8 - width..].to_string())
        })?,
    )?;
    Ok(table)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `test` on a thread with a script thread's stack: nesting 1000
    /// deep takes more than a test thread has in a debug build.
    fn with_script_stack(test: impl FnOnce() + Send + 'static) {
        std::thread::Builder::new().stack_size(SCRIPT_STACK_BYTES).spawn(test).unwrap().join().unwrap();
    }

    fn lua() -> Lua {
        let lua = Lua::new();
        lua.globals().set("cjson", cjson(&lua).unwrap()).unwrap();
        lua.globals().set("bit", bit(&lua).unwrap()).unwrap();
        lua
    }

    fn eval(lua: &Lua, code: &str) -> String {
        match lua.load(code).eval::<Value>() {
            Ok(value) => lua
                .coerce_string(value)
                .unwrap()
                .map(|text| text.to_str().unwrap().to_string())
                .unwrap_or_default(),
            Err(error) => format!("error: {error}"),
        }
    }

    #[test]
    fn json_encodes_as_lua_cjson_does() {
        with_script_stack(json_encodes_as_lua_cjson_does_here);
    }

    fn json_encodes_as_lua_cjson_does_here() {
        let lua = lua();
        assert_eq!(eval(&lua, "return cjson.encode({1,2,{a=1}})"), r#"[1,2,{"a":1}]"#);
        assert_eq!(eval(&lua, "return cjson.encode({})"), "{}");
        assert_eq!(eval(&lua, "return cjson.encode({1,nil,3})"), "[1,null,3]");
        assert_eq!(eval(&lua, "return cjson.encode('a/\"b\\n')"), r#""a\/\"b\n""#);
        assert_eq!(eval(&lua, "return cjson.encode(0.1)"), "0.1");
        assert_eq!(eval(&lua, "return cjson.encode(1/3)"), "0.33333333333333");
        assert_eq!(eval(&lua, "return cjson.encode(1e20)"), "1e+20");
        assert_eq!(eval(&lua, "return cjson.encode(cjson.null)"), "null");
        assert!(eval(&lua, "return cjson.encode({[20]=1})").contains("excessively sparse"));
        assert!(eval(&lua, "return cjson.encode(function() end)").contains("type not supported"));
        assert!(eval(&lua, "local t = {} t[1] = t return cjson.encode(t)").contains("excessive nesting"));
    }

    #[test]
    fn json_decodes_values_and_rejects_garbage() {
        with_script_stack(json_decodes_values_and_rejects_garbage_here);
    }

    fn json_decodes_values_and_rejects_garbage_here() {
        let lua = lua();
        assert_eq!(eval(&lua, r#"local t = cjson.decode('{"a":[1,2,{"b":"c"}]}') return t.a[3].b"#), "c");
        assert_eq!(eval(&lua, r#"return cjson.decode('[1,null,3]')[2] == cjson.null"#), "");
        assert_eq!(eval(&lua, r#"return tostring(cjson.decode('[1,null,3]')[2] == cjson.null)"#), "true");
        assert_eq!(eval(&lua, r#"return cjson.decode('"\\u00e9\\ud83d\\ude00"')"#), "é😀");
        assert_eq!(eval(&lua, r#"return cjson.decode(' -1.5e2 ')"#), "-150");
        for (bad, message) in [
            ("{", "Expected object key string but found T_END at character 2"),
            ("[1,]", "Expected value but found T_ARR_END at character 4"),
            ("nul", "Expected value but found invalid token at character 1"),
            ("1 2", "Expected the end but found T_NUMBER at character 3"),
            ("\"abc", "Expected value but found unexpected end of string at character 1"),
            ("", "Expected value but found T_END at character 1"),
            ("01", "Expected value but found invalid number at character 1"),
        ] {
            let got = eval(&lua, &format!("return cjson.decode('{bad}')"));
            assert!(got.contains(message), "{bad}: {got}");
        }
        let deep = "[".repeat(2000);
        assert!(eval(&lua, &format!("return cjson.decode('{deep}')")).contains("nested"));
    }

    #[test]
    fn bit_operations_wrap_at_32_bits() {
        let lua = lua();
        assert_eq!(eval(&lua, "return bit.band(7, 3)"), "3");
        assert_eq!(eval(&lua, "return bit.bor(1, 2, 4)"), "7");
        assert_eq!(eval(&lua, "return bit.tobit(2^32 + 5)"), "5");
        assert_eq!(eval(&lua, "return bit.tobit(0xffffffff)"), "-1");
        assert_eq!(eval(&lua, "return bit.lshift(1, 31)"), "-2147483648");
        assert_eq!(eval(&lua, "return bit.rshift(-1, 28)"), "15");
        assert_eq!(eval(&lua, "return bit.arshift(-16, 2)"), "-4");
        assert_eq!(eval(&lua, "return bit.tohex(255)"), "000000ff");
        assert_eq!(eval(&lua, "return bit.tohex(255, -2)"), "FF");
        assert_eq!(eval(&lua, "return bit.bswap(0x12345678)"), "2018915346");
        assert_eq!(eval(&lua, "return bit.rol(1, 33)"), "2");
        assert!(eval(&lua, "return bit.band('x')")
            .contains("bad argument #1 to 'band' (number expected, got string)"));
    }
}
