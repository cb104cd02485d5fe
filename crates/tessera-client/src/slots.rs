//! Where keys live in a Redis Cluster: the slot map from CLUSTER SLOTS,
//! corrected by MOVED replies, and the redirections themselves.

use tessera_wire::slot::SLOTS;
use tessera_wire::Value;

/// Which endpoint serves each slot: the master, and a replica for eventual reads.
#[derive(Clone, Debug)]
pub struct SlotMap {
    /// Endpoint addresses; the map refers to them by index.
    pub addresses: Vec<String>,
    pub master: Vec<u16>,
    pub replica: Vec<Option<u16>>,
}

impl SlotMap {
    /// Builds the map from a CLUSTER SLOTS reply; every slot must be served.
    pub fn from_cluster_slots(reply: &Value) -> Result<Self, String> {
        let bad = |what: &str| format!("unexpected CLUSTER SLOTS reply: {what}");
        let Value::Array(ranges) = reply else { return Err(bad("not an array")) };
        let mut map =
            Self { addresses: Vec::new(), master: vec![u16::MAX; SLOTS], replica: vec![None; SLOTS] };
        for range in ranges {
            let Value::Array(parts) = range else { return Err(bad("a range is not an array")) };
            let (Some(Value::Integer(start)), Some(Value::Integer(end))) = (parts.first(), parts.get(1))
            else {
                return Err(bad("a range has no bounds"));
            };
            if !(0..SLOTS as i64).contains(start) || !(*start..SLOTS as i64).contains(end) {
                return Err(bad("slot out of range"));
            }
            let master =
                map.endpoint(node_address(parts.get(2)).ok_or_else(|| bad("a range has no master"))?);
            let replica =
                parts.get(3).and_then(|node| node_address(Some(node))).map(|address| map.endpoint(address));
            for slot in *start as usize..=*end as usize {
                map.master[slot] = master;
                map.replica[slot] = replica;
            }
        }
        if let Some(slot) = map.master.iter().position(|master| *master == u16::MAX) {
            return Err(format!("the cluster serves no node for slot {slot}"));
        }
        Ok(map)
    }

    /// A MOVED reply: `slot` is served by endpoint `to` now, and so, most
    /// likely, are the slots around it that the same endpoint served (a
    /// group's range whose head moved, or that a failover handed on), as
    /// Redis Cluster clients that refresh their map on MOVED learn. A wrong
    /// guess costs one more MOVED.
    pub fn moved(&mut self, slot: usize, to: u16) {
        let from = self.master[slot];
        let first = (0..slot).rev().take_while(|other| self.master[*other] == from).last().unwrap_or(slot);
        let last = (slot + 1..SLOTS).take_while(|other| self.master[*other] == from).last().unwrap_or(slot);
        self.master[first..=last].fill(to);
    }

    /// The index of an endpoint, added if new.
    pub fn endpoint(&mut self, address: String) -> u16 {
        match self.addresses.iter().position(|known| *known == address) {
            Some(index) => index as u16,
            None => {
                self.addresses.push(address);
                (self.addresses.len() - 1) as u16
            }
        }
    }
}

fn node_address(node: Option<&Value>) -> Option<String> {
    let Value::Array(parts) = node? else { return None };
    let host = String::from_utf8_lossy(parts.first()?.as_bytes()?).into_owned();
    let Value::Integer(port) = parts.get(1)? else { return None };
    Some(if host.contains(':') { format!("[{host}]:{port}") } else { format!("{host}:{port}") })
}

/// A redirection from a cluster node: `MOVED slot address` or `ASK slot address`.
#[derive(Debug, PartialEq, Eq)]
pub struct Redirect {
    pub slot: usize,
    pub address: String,
    /// ASK: this once, and with ASKING first; MOVED: from now on.
    pub ask: bool,
}

impl Redirect {
    pub fn parse(message: &str) -> Option<Self> {
        let mut words = message.split(' ');
        let ask = match words.next()? {
            "MOVED" => false,
            "ASK" => true,
            _ => return None,
        };
        let slot = words.next()?.parse().ok().filter(|slot| *slot < SLOTS)?;
        let address = words.next()?.to_string();
        Some(Self { slot, address, ask })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redirects_parse() {
        assert_eq!(
            Redirect::parse("MOVED 3999 127.0.0.1:6381"),
            Some(Redirect { slot: 3999, address: "127.0.0.1:6381".into(), ask: false })
        );
        assert!(Redirect::parse("ASK 1 h:1").unwrap().ask);
        assert_eq!(Redirect::parse("MOVED 99999 h:1"), None);
        assert_eq!(Redirect::parse("ERR nope"), None);
    }

    #[test]
    fn slot_maps_come_from_cluster_slots() {
        let node = |port: i64| Value::Array(vec![Value::Bulk("127.0.0.1".into()), Value::Integer(port)]);
        let reply = Value::Array(vec![
            Value::Array(vec![Value::Integer(0), Value::Integer(8191), node(7000), node(7003)]),
            Value::Array(vec![Value::Integer(8192), Value::Integer(16383), node(7001)]),
        ]);
        let map = SlotMap::from_cluster_slots(&reply).unwrap();
        assert_eq!(map.addresses, ["127.0.0.1:7000", "127.0.0.1:7003", "127.0.0.1:7001"]);
        assert_eq!((map.master[0], map.replica[0]), (0, Some(1)));
        assert_eq!((map.master[16383], map.replica[16383]), (2, None));
        let partial = Value::Array(vec![Value::Array(vec![Value::Integer(0), Value::Integer(10), node(1)])]);
        assert!(SlotMap::from_cluster_slots(&partial).unwrap_err().contains("slot 11"));
    }

    #[test]
    fn a_moved_slot_takes_the_run_its_old_endpoint_served_with_it() {
        let mut map = SlotMap {
            addresses: vec!["a".into(), "b".into(), "c".into()],
            master: vec![0; SLOTS],
            replica: vec![None; SLOTS],
        };
        map.master[100..200].fill(1);
        map.master[200..300].fill(0);
        map.moved(150, 2);
        assert!(map.master[100..200].iter().all(|endpoint| *endpoint == 2), "the whole run moved");
        assert_eq!((map.master[99], map.master[200]), (0, 0), "the neighbours' runs stayed");
        map.moved(0, 1);
        assert!(map.master[..100].iter().all(|endpoint| *endpoint == 1));
        assert_eq!(map.master[200], 0);
    }
}
