//! Keyset pages of the listings whose rows are ordered by creation (agents, models, tenants,
//! operator keys): `?limit=<n>&cursor=<c>`, and `next_cursor` in the answer — the `cursor` of
//! the next page, null on the last. A cursor names the last row of a page (its creation time
//! and id), so a page is the same whatever was added or deleted before it, and no listing is
//! ever read whole.

use serde::Deserialize;

use crate::error::ApiError;

/// Rows a page holds when `limit` is not given.
pub const DEFAULT_LIMIT: i64 = 100;
/// Rows a page may hold at most.
pub const MAX_LIMIT: i64 = 1000;

/// `?limit=<n>&cursor=<c>`.
#[derive(Debug, Clone, Default, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ListPage {
    /// Rows at most (1–1000, default 100).
    pub limit: Option<i64>,
    /// The previous page's `next_cursor`.
    pub cursor: Option<String>,
}

/// Where a page starts (after this row) and its size.
pub type Bounds = (Option<(i64, String)>, i64);

impl ListPage {
    /// The page's start and size, or 400 `invalid_request`.
    pub fn bounds(&self) -> Result<Bounds, ApiError> {
        let limit = self.limit.unwrap_or(DEFAULT_LIMIT);
        if !(1..=MAX_LIMIT).contains(&limit) {
            return Err(ApiError::invalid(format!("limit must be 1 to {MAX_LIMIT}")));
        }
        let after = match &self.cursor {
            None => None,
            Some(c) => Some(parse(c).ok_or_else(|| ApiError::invalid("invalid cursor"))?),
        };
        Ok((after, limit))
    }
}

fn parse(cursor: &str) -> Option<(i64, String)> {
    let (at, id) = cursor.split_once('.')?;
    let ok = !id.is_empty()
        && id.len() <= 64
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    Some((at.parse().ok()?, id.to_string())).filter(|_| ok)
}

/// The cursor after a row created at `at` with `id`.
pub fn cursor(at: i64, id: &str) -> String {
    format!("{at}.{id}")
}

/// Cuts a page fetched with one row more than `limit`: the rows, and the next page's cursor if
/// the extra row was there (`key`: a row's creation time and id).
pub fn cut<T>(
    mut rows: Vec<T>,
    limit: i64,
    key: impl Fn(&T) -> (i64, &str),
) -> (Vec<T>, Option<String>) {
    let limit = usize::try_from(limit).unwrap_or(usize::MAX);
    if rows.len() <= limit {
        return (rows, None);
    }
    rows.truncate(limit);
    let next = rows.last().map(|r| {
        let (at, id) = key(r);
        cursor(at, id)
    });
    (rows, next)
}

/// A page of `tenant`'s agents (`/v1/agents`, `/v1/models`) and the next page's cursor.
pub async fn agents(
    store: &engram_store::Store,
    tenant: &str,
    page: &ListPage,
) -> Result<(Vec<engram_store::Agent>, Option<String>), ApiError> {
    let (after, limit) = page.bounds()?;
    let rows = store
        .agents_page(
            tenant,
            after.as_ref().map(|(t, id)| (*t, id.as_str())),
            limit + 1,
        )
        .await?;
    Ok(cut(rows, limit, |a| (a.created_at, &a.id)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursors_round_trip_and_bad_ones_are_refused() {
        let c = cursor(1_700_000, "ag_0123abcd");
        let page = ListPage {
            limit: Some(5),
            cursor: Some(c),
        };
        assert_eq!(
            page.bounds().unwrap(),
            (Some((1_700_000, "ag_0123abcd".to_string())), 5)
        );
        for bad in ["", "12", "x.ag_1", "12.", "12.a b", "12.a.b"] {
            let p = ListPage {
                limit: None,
                cursor: Some(bad.into()),
            };
            assert!(p.bounds().is_err(), "{bad}");
        }
        for limit in [0, -1, 1001] {
            let p = ListPage {
                limit: Some(limit),
                cursor: None,
            };
            assert!(p.bounds().is_err(), "{limit}");
        }
        let (rows, next) = cut(vec![(1, "a"), (2, "b"), (3, "c")], 2, |r| (r.0, r.1));
        assert_eq!((rows.len(), next.as_deref()), (2, Some("2.b")));
        let (rows, next) = cut(vec![(1, "a")], 2, |r| (r.0, r.1));
        assert_eq!((rows.len(), next), (1, None));
    }
}
