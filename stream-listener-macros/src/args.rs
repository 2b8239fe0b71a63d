//! The attribute's arguments: `key = value` pairs, each key at most once, errors at the offending
//! token.

use proc_macro2::{Span, TokenStream};
use syn::meta::ParseNestedMeta;
use syn::parse::Parser;
use syn::{Lit, LitStr, Path};

/// The keys `#[stream_listener(...)]` accepts, in the order the error message lists them.
const KEYS: [&str; 9] = [
    "stream",
    "group",
    "concurrency",
    "name",
    "crate",
    "on_assigned",
    "on_revoked",
    "on_lost",
    "batch",
];

/// The lifecycle hook keys (docs/design.md §13.3): each takes a path to an
/// `async fn(ShardHookContext) -> ()` or `-> Result<(), E>`.
pub(crate) const HOOK_KEYS: [&str; 3] = ["on_assigned", "on_revoked", "on_lost"];

/// The keys whose value names something in Redis (docs/design.md §2): the key, an example value,
/// what it names, the characters it must not contain, and why.
#[rustfmt::skip]
const NAME_KEYS: [(&str, &str, &str, &str, &str); 2] = [
    ("stream", "\"orders\"", "stream prefix", "{}", "braces would change the Redis Cluster hash slot of its keys"),
    ("group", "\"billing\"", "consumer group", "{}:", "braces would change hash slots and ':' would let two groups share keys"),
];

/// The parsed arguments; `None` for keys not given.
#[derive(Default)]
pub(crate) struct Args {
    pub(crate) stream: Option<LitStr>,
    pub(crate) group: Option<LitStr>,
    pub(crate) concurrency: Option<(u32, Span)>,
    pub(crate) name: Option<LitStr>,
    pub(crate) krate: Option<Path>,
    /// `on_assigned`, `on_revoked`, `on_lost`, in the order of [`HOOK_KEYS`].
    pub(crate) hooks: [Option<Path>; 3],
    /// `batch = true`: a batch listener whatever its last argument's type is called (a type
    /// alias of `Batch<T>`); `batch = false`: a per-entry listener even when the last
    /// argument's type is called `Batch`. Not given: inferred from that name.
    pub(crate) batch: Option<(bool, Span)>,
}

/// Fills `slot` once; a second occurrence is an error at its key.
fn set_once<T>(slot: &mut Option<T>, value: T, meta: &ParseNestedMeta<'_>) -> syn::Result<()> {
    if slot.is_some() {
        return Err(syn::Error::new_spanned(
            &meta.path,
            format!("duplicate key `{}`: give it once", path_text(&meta.path)),
        ));
    }
    *slot = Some(value);
    Ok(())
}

fn path_text(path: &Path) -> String {
    path.segments
        .iter()
        .map(|s| s.ident.to_string())
        .collect::<Vec<_>>()
        .join("::")
}

fn string_value(meta: &ParseNestedMeta<'_>, key: &str, example: &str) -> syn::Result<LitStr> {
    let value = meta.value()?;
    let lit: Lit = value.parse().map_err(|e| {
        syn::Error::new(
            e.span(),
            format!("`{key}` takes a string literal, e.g. `{key} = {example}`"),
        )
    })?;
    match lit {
        Lit::Str(s) => Ok(s),
        other => Err(syn::Error::new(
            other.span(),
            format!("`{key}` takes a string literal, e.g. `{key} = {example}`"),
        )),
    }
}

/// The value of a hook key: a path to a function (`on_revoked = flush_state`), not a string or
/// a closure; the error is at the value.
fn hook_path(meta: &ParseNestedMeta<'_>, key: &str) -> syn::Result<Path> {
    let value = meta.value()?;
    let expr: syn::Expr = value.parse()?;
    match expr {
        syn::Expr::Path(syn::ExprPath {
            qself: None, path, ..
        }) => Ok(path),
        other => Err(syn::Error::new_spanned(
            other,
            format!(
                "`{key}` takes a path to an `async fn(ShardHookContext)`, e.g. `{key} = hooks::{key}`"
            ),
        )),
    }
}

/// Checks a name against the key layout's rules (docs/design.md §2), at compile time.
fn check_name(lit: &LitStr, kind: &str, forbidden: &str, why: &str) -> syn::Result<()> {
    let value = lit.value();
    if value.is_empty() {
        return Err(syn::Error::new(
            lit.span(),
            format!("the {kind} is empty: give a non-empty name"),
        ));
    }
    if let Some(c) = value
        .chars()
        .find(|c| forbidden.contains(*c) || c.is_whitespace() || c.is_control())
    {
        return Err(syn::Error::new(
            lit.span(),
            format!("the {kind} {value:?} contains {c:?}, which is not allowed ({why})"),
        ));
    }
    Ok(())
}

/// Edit distance, for "did you mean" hints on misspelt keys.
fn distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut previous = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let current = row[j + 1];
            row[j + 1] = (previous + usize::from(ca != *cb))
                .min(row[j] + 1)
                .min(row[j + 1] + 1);
            previous = current;
        }
    }
    row[b.len()]
}

fn unknown_key(meta: &ParseNestedMeta<'_>) -> syn::Error {
    let key = path_text(&meta.path);
    let valid = KEYS
        .iter()
        .map(|k| format!("`{k}`"))
        .collect::<Vec<_>>()
        .join(", ");
    let hint = KEYS
        .iter()
        .map(|k| (distance(&key, k), k))
        .filter(|(d, _)| *d <= 2)
        .min()
        .map(|(_, k)| format!(" (did you mean `{k}`?)"))
        .unwrap_or_default();
    meta.error(format!("unknown key `{key}`{hint}; valid keys are {valid}"))
}

/// Parses the attribute's arguments. Errors point at the offending key or value.
pub(crate) fn parse(tokens: TokenStream) -> syn::Result<Args> {
    let mut args = Args::default();
    let parser = syn::meta::parser(|meta| {
        let name_key = NAME_KEYS.iter().find(|k| meta.path.is_ident(k.0));
        if let Some(&(key, example, kind, forbidden, why)) = name_key {
            let lit = string_value(&meta, key, example)?;
            check_name(&lit, kind, forbidden, why)?;
            let slot = if key == "stream" {
                &mut args.stream
            } else {
                &mut args.group
            };
            set_once(slot, lit, &meta)
        } else if meta.path.is_ident("name") {
            let lit = string_value(&meta, "name", "\"on_order\"")?;
            if lit.value().is_empty() {
                return Err(syn::Error::new(lit.span(), "the listener name is empty"));
            }
            set_once(&mut args.name, lit, &meta)
        } else if meta.path.is_ident("concurrency") {
            let value = meta.value()?;
            let lit: Lit = value.parse()?;
            let Lit::Int(int) = &lit else {
                return Err(syn::Error::new(
                    lit.span(),
                    "`concurrency` takes an integer, the number of group members in this process, e.g. `concurrency = 4`",
                ));
            };
            // 1024: the core's `MAX_CONCURRENCY` (the largest shard count), which `Listener::new`
            // enforces too; said here at the value instead of at `run()`.
            let too_large = || {
                syn::Error::new(
                    int.span(),
                    "`concurrency` must be an integer from 1 to 1024 (the largest shard count: more members could never own a shard)",
                )
            };
            let n: u32 = int.base10_parse().map_err(|_| too_large())?;
            if n > 1024 {
                return Err(too_large());
            }
            if n == 0 {
                return Err(syn::Error::new(
                    int.span(),
                    "`concurrency` must be at least 1: it is the number of group members this process runs",
                ));
            }
            set_once(&mut args.concurrency, (n, int.span()), &meta)
        } else if meta.path.is_ident("crate") {
            let lit = string_value(&meta, "crate", "\"::my_reexport::stream_listener\"")?;
            let path: Path = lit.parse().map_err(|_| {
                syn::Error::new(
                    lit.span(),
                    format!(
                        "`crate` takes a path, e.g. \"::stream_listener\", not {:?}",
                        lit.value()
                    ),
                )
            })?;
            set_once(&mut args.krate, path, &meta)
        } else if meta.path.is_ident("batch") {
            let value = meta.value()?;
            let lit: Lit = value.parse()?;
            let Lit::Bool(flag) = &lit else {
                return Err(syn::Error::new(
                    lit.span(),
                    "`batch` takes `true` or `false`: whether the function handles a `Batch<T>` of entries",
                ));
            };
            set_once(&mut args.batch, (flag.value, flag.span), &meta)
        } else if let Some(index) = HOOK_KEYS.iter().position(|k| meta.path.is_ident(k)) {
            let path = hook_path(&meta, HOOK_KEYS[index])?;
            set_once(&mut args.hooks[index], path, &meta)
        } else {
            Err(unknown_key(&meta))
        }
    });
    parser.parse2(tokens)?;
    Ok(args)
}

#[cfg(test)]
mod tests {
    /// The runtime refuses more members than the largest shard count (`MAX_CONCURRENCY`); the
    /// attribute says so at compile time, at the value.
    #[test]
    fn concurrency_is_1_to_1024() {
        let parse =
            |text: &str| super::parse(text.parse().unwrap()).map(|a| a.concurrency.map(|c| c.0));
        assert_eq!(
            parse("stream = \"s\", group = \"g\", concurrency = 1024").unwrap(),
            Some(1024)
        );
        for text in ["concurrency = 1025", "concurrency = 4294967296"] {
            let error = parse(&format!("stream = \"s\", group = \"g\", {text}")).unwrap_err();
            assert_eq!(
                error.to_string(),
                "`concurrency` must be an integer from 1 to 1024 (the largest shard count: more members could never own a shard)",
                "{text}"
            );
        }
    }

    #[test]
    fn close_keys_are_suggested() {
        assert_eq!(super::distance("strem", "stream"), 1);
        assert_eq!(super::distance("concurency", "concurrency"), 1);
        assert!(super::distance("topic", "stream") > 2);
    }
}
