//! Table management: TABLE.CREATE, TABLE.DROP, TABLE.LIST, TABLE.INFO.

use std::collections::BTreeMap;

use tessera_wire::Request;

use super::{is, CommandSpec, Context};
use crate::error::{CommandError, CommandResult};
use crate::tables::{escape_prefix, TableDef};

#[rustfmt::skip]
pub const COMMANDS: &[CommandSpec] = &[
    CommandSpec { name: "table.create", arity: -6, flags: &["write", "admin"], first_key: 0, last_key: 0, step: 0, handler: create },
    CommandSpec { name: "table.drop", arity: 2, flags: &["write", "admin"], first_key: 0, last_key: 0, step: 0, handler: drop_table },
    CommandSpec { name: "table.list", arity: 1, flags: &["readonly"], first_key: 0, last_key: 0, step: 0, handler: list },
    CommandSpec { name: "table.info", arity: 2, flags: &["readonly"], first_key: 0, last_key: 0, step: 0, handler: info },
];

pub fn text(arg: &[u8]) -> CommandResult<String> {
    String::from_utf8(arg.to_vec())
        .map_err(|_| CommandError::Other("table arguments must be UTF-8 text".into()))
}

/// TABLE.CREATE name PREFIX p ENGINE e [option value ...]
fn create(context: &mut Context, request: &Request) -> CommandResult {
    let def = parse_create(request)?;
    context.store.create_table(def).map_err(|error| CommandError::Other(error.to_string()))?;
    context.out.ok();
    Ok(())
}

/// The table a TABLE.CREATE asks for.
pub fn parse_create(request: &Request) -> CommandResult<TableDef> {
    if !is(request.arg(2), "prefix") || !is(request.arg(4), "engine") || !request.len().is_multiple_of(2) {
        return Err(CommandError::Other(
            "usage: TABLE.CREATE name PREFIX prefix ENGINE engine [option value ...]".into(),
        ));
    }
    let mut options = BTreeMap::new();
    for index in (6..request.len()).step_by(2) {
        options.insert(text(request.arg(index))?.to_ascii_lowercase(), text(request.arg(index + 1))?);
    }
    Ok(TableDef {
        name: text(request.arg(1))?,
        prefix: escape_prefix(request.arg(3)),
        engine: text(request.arg(5))?.to_ascii_lowercase(),
        options,
    })
}

fn drop_table(context: &mut Context, request: &Request) -> CommandResult {
    let name = text(request.arg(1))?;
    context.store.drop_table(&name).map_err(|error| CommandError::Other(error.to_string()))?;
    context.out.ok();
    Ok(())
}

fn list(context: &mut Context, _request: &Request) -> CommandResult {
    let tables = context.tables.by_name();
    context.out.array(tables.len());
    for table in tables {
        context.out.bulk(table.def.name.as_bytes());
    }
    Ok(())
}

fn info(context: &mut Context, request: &Request) -> CommandResult {
    let name = text(request.arg(1))?;
    let table =
        context.tables.get(&name).ok_or_else(|| CommandError::Other(format!("no such table '{name}'")))?;
    let capabilities = table.engine.capabilities();
    let keys = table.engine.len()?;
    let options: Vec<String> = table
        .def
        .options
        .iter()
        .filter(|(option, _)| option.as_str() != "password")
        .map(|(option, value)| format!("{option}={value}"))
        .collect();
    let out = &mut *context.out;
    out.map(7);
    out.bulk(b"name");
    out.bulk(table.def.name.as_bytes());
    out.bulk(b"prefix");
    out.bulk(&table.prefix);
    out.bulk(b"engine");
    out.bulk(table.spec.kind.name().as_bytes());
    out.bulk(b"options");
    out.bulk(options.join(" ").as_bytes());
    out.bulk(b"keys");
    out.integer(keys as i64);
    out.bulk(b"ordered");
    out.boolean(capabilities.ordered);
    out.bulk(b"persistent");
    out.boolean(capabilities.persistent);
    Ok(())
}
