//! The expansion of `#[stream_listener(...)]`: the function, untouched, plus a hidden registration.

use proc_macro2::{Span, TokenStream};
use quote::{quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{FnArg, ItemFn, ReturnType};

use crate::args::{self, Args};

/// Expands the attribute. On any error, the function is still emitted (so the rest of the crate
/// and the IDE keep working) next to the compile errors.
pub(crate) fn expand(args: TokenStream, item: TokenStream) -> TokenStream {
    let function: ItemFn = match syn::parse2(item.clone()) {
        Ok(function) => function,
        Err(error) => {
            let error = syn::Error::new(
                error.span(),
                "#[stream_listener] goes on an `async fn` with one argument, e.g. `async fn on_order(Json(order): Json<Order>)`",
            );
            return with_error(item, error);
        }
    };
    match expand_fn(args, &function) {
        Ok(tokens) => tokens,
        Err(error) => with_error(quote!(#function), error),
    }
}

fn with_error(item: TokenStream, error: syn::Error) -> TokenStream {
    let error = error.into_compile_error();
    quote! { #item #error }
}

/// Collects every error rather than stopping at the first.
fn push(errors: &mut Option<syn::Error>, error: syn::Error) {
    match errors {
        Some(first) => first.combine(error),
        None => *errors = Some(error),
    }
}

fn check_signature(function: &ItemFn, errors: &mut Option<syn::Error>) {
    let sig = &function.sig;
    if sig.asyncness.is_none() {
        push(
            errors,
            syn::Error::new(
                sig.fn_token.span,
                "the `async` keyword is missing from the function declaration: #[stream_listener] goes on an `async fn`",
            ),
        );
    }
    if let Some(receiver) = sig.receiver() {
        push(
            errors,
            syn::Error::new_spanned(
                receiver,
                "#[stream_listener] cannot be used on a method: write a free `async fn` without `self` (keep shared state in a `static`, e.g. a `OnceLock`)",
            ),
        );
    }
    if !sig.generics.params.is_empty() || sig.generics.where_clause.is_some() {
        let generics = if sig.generics.params.is_empty() {
            let where_clause = &sig.generics.where_clause;
            quote!(#where_clause)
        } else {
            let generics = &sig.generics;
            quote!(#generics)
        };
        push(
            errors,
            syn::Error::new_spanned(
                generics,
                "a listener function cannot be generic: the framework calls it with one concrete argument type",
            ),
        );
    }
    if let Some(variadic) = &sig.variadic {
        push(
            errors,
            syn::Error::new(variadic.span(), "a listener function cannot be variadic"),
        );
    }
    let typed: Vec<&FnArg> = sig
        .inputs
        .iter()
        .filter(|a| matches!(a, FnArg::Typed(_)))
        .collect();
    match typed.len() {
        1 => {}
        0 if sig.receiver().is_none() => push(
            errors,
            syn::Error::new(
                sig.paren_token.span.join(),
                "a listener function takes exactly one argument, an extractor: `Json<T>`, `Message<T>`, `RawMessage` or `Delivery`; it has none",
            ),
        ),
        0 => {}
        n => push(
            errors,
            syn::Error::new(
                typed[1].span(),
                format!(
                    "a listener function takes exactly one argument, an extractor: `Json<T>`, `Message<T>`, `RawMessage` or `Delivery`; it has {n} (`Message<T>` carries the payload and its metadata together)"
                ),
            ),
        ),
    }
}

fn expand_fn(args: TokenStream, function: &ItemFn) -> syn::Result<TokenStream> {
    let mut errors = None;
    let args = match args::parse(args) {
        Ok(args) => Some(args),
        Err(error) => {
            push(&mut errors, error);
            None
        }
    };
    if let Some(args) = &args {
        for (value, key, example) in [
            (args.stream.is_none(), "stream", "stream = \"orders\""),
            (args.group.is_none(), "group", "group = \"billing\""),
        ] {
            if value {
                push(
                    &mut errors,
                    syn::Error::new(
                        Span::call_site(),
                        format!(
                            "missing `{key}`: #[stream_listener] needs `stream` and `group`, e.g. #[stream_listener({example_both})]",
                            example_both = if key == "stream" {
                                format!("{example}, group = \"billing\"")
                            } else {
                                format!("stream = \"orders\", {example}")
                            }
                        ),
                    ),
                );
            }
        }
    }
    check_signature(function, &mut errors);
    if let Some(errors) = errors {
        return Err(errors);
    }
    let Args {
        stream,
        group,
        concurrency,
        name,
        krate,
        hooks,
    } = args.expect("no errors: the arguments parsed");
    let (Some(stream), Some(group)) = (stream, group) else {
        unreachable!("missing keys are errors above");
    };
    let krate = krate.map_or_else(|| quote!(::stream_listener), |path| quote!(#path));
    let fn_name = &function.sig.ident;
    let name = name.map_or_else(|| fn_name.to_string(), |n| n.value());
    let concurrency = concurrency.map_or(1, |(n, _)| n);
    let Some(FnArg::Typed(argument)) = function.sig.inputs.first() else {
        unreachable!("arity is checked above");
    };
    let argument_ty = &argument.ty;
    let output_span = match &function.sig.output {
        ReturnType::Default => function.sig.ident.span(),
        ReturnType::Type(_, ty) => ty.span(),
    };
    let extract = quote_spanned! {argument_ty.span()=>
        <#argument_ty as #krate::__private::FromDelivery>::from_delivery(&delivery)?
    };
    // The output gets the return type's span, so a wrong return type is reported there.
    let output = syn::Ident::new("output", output_span);
    let outcome = quote_spanned! {output_span=>
        #krate::__private::IntoHandlerResult::into_handler_result(#output)
    };
    let boxed = quote_spanned! {fn_name.span()=>
        ::std::boxed::Box::pin(async move {
            let argument = #extract;
            let #output = #fn_name(argument).await;
            #outcome
        })
    };
    let hooks = hooks
        .iter()
        .zip(crate::args::HOOK_KEYS)
        .map(|(path, key)| hook_fn(&krate, path.as_ref(), key));
    let hooks: Vec<TokenStream> = hooks.collect();
    Ok(quote! {
        #function

        // The registration `run()` collects: the listener's settings and a handler that extracts
        // the argument, calls the function and maps its result (stream-listener, docs/design.md
        // §7).
        #[doc(hidden)]
        const _: () = {
            fn __stream_listener_handler(
                delivery: #krate::__private::Delivery,
            ) -> #krate::__private::HandlerFuture {
                #boxed
            }
            #krate::__private::inventory::submit! {
                #krate::__private::ListenerRegistration::__from_macro(
                    #name,
                    #stream,
                    #group,
                    #concurrency,
                    __stream_listener_handler,
                    ::core::module_path!(),
                    ::core::file!(),
                    ::core::line!(),
                )
                .__with_hooks(#(#hooks),*)
            }
        };
    })
}

/// `Some(wrapper)` for a hook given as `path` (`None` when not given): a plain `fn` that calls
/// it and boxes its future. Spanned at the path, so a hook with the wrong signature is reported
/// there.
fn hook_fn(krate: &TokenStream, path: Option<&syn::Path>, key: &str) -> TokenStream {
    let Some(path) = path else {
        return quote!(::core::option::Option::None);
    };
    let wrapper = syn::Ident::new(&format!("__stream_listener_{key}"), path.span());
    let call = quote_spanned! {path.span()=>
        #krate::__private::IntoHookResult::into_hook_result(#path(context).await)
    };
    quote! {
        ::core::option::Option::Some({
            fn #wrapper(
                context: #krate::__private::ShardHookContext,
            ) -> #krate::__private::HookFuture {
                ::std::boxed::Box::pin(async move { #call })
            }
            #wrapper as #krate::__private::HookFn
        })
    }
}
