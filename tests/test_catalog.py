"""The catalog: shipped datasheet numbers, name lookup, user catalogs, money as exact decimals."""

from __future__ import annotations

import subprocess
import sys
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from tunepilot.catalog import (
    DEFAULT_CATALOG_PATH,
    PEAK_KEYS,
    Catalog,
    cents_to_usd,
    load_catalog,
    normalise_card_name,
    usd_to_cents,
)
from tunepilot.errors import UserError

# (id, dense BF16 TFLOP/s, memory bytes, HBM TB/s, scale-up GB/s, max W) from cards_and_billing.md
DATASHEET = [
    # memory as sold (decimal GB); capacity_bytes is the total the device reports
    ("a100-sxm-80gb", 312, 80, 2.039, 600, 400),
    ("h100-sxm-80gb", 989.4, 80, 3.35, 900, 700),
    ("h200-sxm-141gb", 989.4, 141, 4.8, 900, 700),
    ("mi300x-192gb", 1307.4, 192, 5.3, 896, 750),
]


@pytest.fixture(scope="module")
def shipped() -> Catalog:
    return load_catalog()


def write_catalog(tmp_path: Path, data: dict, name: str = "mine.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


def full_card(shipped: Catalog, card_id: str, **changes) -> dict:
    """A complete card entry as a user would write it (money as strings), based on a shipped one."""
    return {**shipped.get(card_id).model_dump(mode="json"), **changes}


# --- the shipped catalog ---------------------------------------------------------------------

def test_shipped_catalog_loads_four_cards(shipped):
    assert [c.id for c in shipped.cards] == [row[0] for row in DATASHEET]
    assert shipped.schema_version == 1
    assert shipped.as_of and "example" in shipped.note.lower()
    assert shipped.paths == (DEFAULT_CATALOG_PATH,)


@pytest.mark.parametrize(("card_id", "bf16", "memory_bytes", "tbps", "link_gbps", "tdp_w"),
                         DATASHEET)
def test_shipped_cards_carry_dense_datasheet_numbers(shipped, card_id, bf16, memory_bytes, tbps,
                                                     link_gbps, tdp_w):
    card = shipped.get(card_id)
    assert card.peak_tflops.bf16 == bf16
    assert card.peak_flops("bf16") == pytest.approx(bf16 * 1e12, rel=1e-12)
    assert card.peak_flops("fp16") == card.peak_flops("bf16")
    assert card.memory_gb == memory_bytes
    assert card.capacity_bytes == card.memory_bytes
    # the device reports more than the decimal GB it is sold as (80 GB cards hold 80 GiB)
    assert memory_bytes * 10**9 < card.capacity_bytes < memory_bytes * 10**9 * 1.08
    assert card.hbm_bandwidth_tbps == tbps
    assert card.hbm_bandwidth_bytes_per_s == pytest.approx(tbps * 1e12, rel=1e-12)
    assert card.scale_up.bandwidth_gbps == link_gbps
    assert card.tdp_w == tdp_w


def test_fp8_tf32_fp32_dense_figures(shipped):
    assert shipped.get("a100").peak_flops("fp8") is None  # Ampere has no FP8 tensor cores
    assert shipped.get("h100").peak_tflops.fp8 == 1979
    assert shipped.get("mi300x").peak_tflops.fp8 == 2614.9
    assert shipped.get("h200").peak_tflops.tf32 == 494.7
    assert shipped.get("mi300x").peak_tflops.fp32 == 163.4
    assert shipped.get("a100").software_stack == "cuda"
    assert shipped.get("mi300x").software_stack == "rocm"


def test_every_card_number_names_its_source(shipped):
    for card in shipped.cards:
        assert card.sources, card.id
        for source in card.sources:
            assert source.source and source.as_of, card.id
        cited = " ".join(source.what for source in card.sources)
        for field in ("peak_tflops", "memory_gb", "memory_bytes", "hbm_bandwidth_tbps",
                      "scale_up", "tdp_w"):
            assert field in cited, f"{card.id}: {field} has no source"
        assert card.pricing.source and card.pricing.as_of, card.id
        assert "example" in card.pricing.source, card.id
        assert card.inventory.source, card.id


def test_shipped_money_is_quoted_decimal_strings(shipped):
    raw = yaml.safe_load(DEFAULT_CATALOG_PATH.read_text(encoding="utf-8"))
    for entry in raw["cards"]:
        pricing = entry["pricing"]
        assert isinstance(pricing["on_demand_usd_per_hour"], str)
        assert all(isinstance(t["discount_percent"], str) for t in pricing["terms"])
        assert all(isinstance(o["usd"], str) for o in pricing["options"].values())
    for card in shipped.cards:
        assert isinstance(card.pricing.on_demand_usd_per_hour, Decimal)
        assert [t.name for t in card.pricing.terms] == ["week", "month", "quarter"]
        assert card.pricing.term("Month").hours == 720


def test_prices_and_billing_vary_across_cards(shipped):
    a100, h100, mi300x = (shipped.get(n).pricing for n in ("a100", "h100", "mi300x"))
    assert a100.on_demand_usd_per_hour < h100.on_demand_usd_per_hour
    assert h100.on_demand_usd_per_hour == Decimal("2.49")
    assert mi300x.billing_increment_s == 1  # per-second billing
    assert h100.cancellation.full_refund_before_h == 48
    assert h100.cancellation.partial_refund_percent == Decimal("50")


def test_unknown_precision_and_term_are_user_errors(shipped):
    with pytest.raises(UserError) as err:
        shipped.get("h100").peak_flops("int4")
    assert err.value.field == "precision" and "bf16" in err.value.hint
    with pytest.raises(UserError) as err:
        shipped.get("h100").pricing.term("year")
    assert err.value.field == "term" and "quarter" in err.value.hint
    assert set(PEAK_KEYS) == {"bf16", "fp16", "fp8", "tf32", "fp32"}


def test_catalog_module_does_not_import_torch():
    code = "import sys, tunepilot.catalog; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


# --- names -----------------------------------------------------------------------------------

@pytest.mark.parametrize(("name", "card_id"), [
    ("H100-SXM-80GB", "h100-sxm-80gb"), ("h100", "h100-sxm-80gb"), ("H100_SXM", "h100-sxm-80gb"),
    ("h100 sxm", "h100-sxm-80gb"), ("A100", "a100-sxm-80gb"), ("a100-80gb", "a100-sxm-80gb"),
    ("h200", "h200-sxm-141gb"), ("MI300X", "mi300x-192gb"),
])
def test_card_names_are_normalised(shipped, name, card_id):
    assert shipped.get(name).id == card_id


@pytest.mark.parametrize(("name", "guess"), [("h20", "h200-sxm-141gb"), ("a10", "a100-sxm-80gb"),
                                             ("mi3", "mi300x-192gb")])
def test_a_prefix_is_another_card_not_a_match(shipped, name, guess):
    """H20 and A10 are real GPUs of their own: a prefix of a card's name is refused with a
    'did you mean', never quoted as that card."""
    with pytest.raises(UserError) as err:
        shipped.get(name)
    assert err.value.field == "card" and f"did you mean {guess}" in err.value.hint.lower()


def test_normalise_card_name():
    assert normalise_card_name("H100-SXM_80GB") == normalise_card_name("h100sxm80gb")


def test_unknown_card_suggests_the_closest(shipped):
    with pytest.raises(UserError) as err:
        shipped.get("a100-40gb")
    assert err.value.field == "card"
    assert "a100-40gb" in err.value.message
    assert "did you mean a100-sxm-80gb" in err.value.hint.lower()
    assert "known cards: a100-sxm-80gb, h100-sxm-80gb, h200-sxm-141gb, mi300x-192gb" in \
        err.value.hint.lower()


@pytest.mark.parametrize("name", ["h", "", "tpu-v5"])
def test_ambiguous_empty_or_unrelated_names_are_refused(shipped, name):
    with pytest.raises(UserError) as err:
        shipped.get(name)
    assert err.value.field == "card"
    assert "h100-sxm-80gb" in err.value.message + err.value.hint


# --- user catalogs ---------------------------------------------------------------------------

def test_user_catalog_overrides_a_card_by_alias(shipped, tmp_path):
    mine = dict(full_card(shipped, "h100")["pricing"], on_demand_usd_per_hour="1.99",
                source="quote from my provider", as_of="2027-01-05")
    path = write_catalog(tmp_path, {"cards": [{"id": "H100", "pricing": mine}]})
    catalog = load_catalog(path)
    h100 = catalog.get("h100-sxm-80gb")
    assert h100.pricing.on_demand_usd_per_hour == Decimal("1.99")
    assert h100.pricing.source == "quote from my provider"
    assert h100.peak_tflops.bf16 == 989.4  # keys the user did not give stay shipped
    assert [c.id for c in catalog.cards] == [c.id for c in shipped.cards]
    assert catalog.get("a100").pricing == shipped.get("a100").pricing
    assert catalog.paths == (DEFAULT_CATALOG_PATH, path)


def test_user_override_of_memory_gb_derives_memory_bytes(shipped, tmp_path):
    path = write_catalog(tmp_path, {"cards": [{"id": "h100", "memory_gb": 94}]})
    assert load_catalog(path).get("h100").memory_bytes == 94 * 10**9


def test_user_catalog_adds_a_new_card(shipped, tmp_path):
    new = full_card(shipped, "h100", id="h100-nvl-94gb", aliases=["h100-nvl"],
                    name="NVIDIA H100 NVL 94GB", memory_gb=94, memory_bytes=94 * 10**9)
    catalog = load_catalog(write_catalog(tmp_path, {"cards": [new]}))
    assert len(catalog.cards) == 5
    assert catalog.get("H100 NVL").memory_bytes == 94 * 10**9
    assert catalog.get("h100").id == "h100-sxm-80gb"  # an exact alias beats a prefix


def test_user_catalog_can_replace_the_shipped_one(shipped, tmp_path):
    only = full_card(shipped, "mi300x", id="my-card", aliases=[])
    path = write_catalog(tmp_path, {"replace": True, "schema_version": 1, "cards": [only]})
    catalog = load_catalog(path)
    assert [c.id for c in catalog.cards] == ["my-card"]
    assert catalog.paths == (path,)
    with pytest.raises(UserError):
        catalog.get("h100")


def test_float_money_is_refused_with_its_field_path(shipped, tmp_path):
    pricing = dict(full_card(shipped, "a100")["pricing"], on_demand_usd_per_hour=2.49)
    path = write_catalog(tmp_path, {"cards": [{"id": "a100", "memory_gb": 80},
                                              {"id": "h100", "pricing": pricing}]})
    with pytest.raises(UserError) as err:
        load_catalog(path)
    assert err.value.field == "catalog.cards[1].pricing.on_demand_usd_per_hour"
    assert str(path) in err.value.message and '"2.49"' in err.value.message
    assert "quote" in err.value.hint.lower()
    assert "pydantic" not in str(err.value) and "validation error" not in str(err.value)


def test_float_discount_in_a_replacing_catalog_is_refused(shipped, tmp_path):
    cards = [full_card(shipped, "a100"), full_card(shipped, "h100"), full_card(shipped, "h200")]
    cards[2]["pricing"]["terms"][0]["discount_percent"] = 10.5
    with pytest.raises(UserError) as err:
        load_catalog(write_catalog(tmp_path, {"replace": True, "cards": cards}))
    assert err.value.field == "catalog.cards[2].pricing.terms[0].discount_percent"


def test_int_money_is_accepted(shipped, tmp_path):
    pricing = dict(full_card(shipped, "h100")["pricing"], on_demand_usd_per_hour=2)
    path = write_catalog(tmp_path, {"cards": [{"id": "h100", "pricing": pricing}]})
    assert load_catalog(path).get("h100").pricing.on_demand_usd_per_hour == Decimal(2)


@pytest.mark.parametrize(("change", "field", "words"), [
    (lambda card: card.pop("pricing"), "catalog.cards[0].pricing", "missing"),
    (lambda card: card["pricing"].update(billing_increment_s="a minute"),
     "catalog.cards[0].pricing.billing_increment_s", "integer"),
    (lambda card: card["pricing"].update(on_demand_usd_per_hour="$2.49"),
     "catalog.cards[0].pricing.on_demand_usd_per_hour", "not a decimal"),
    (lambda card: card.update(tdp_watts=700), "catalog.cards[0].tdp_watts", "unknown field"),
    (lambda card: card.update(memory_bytes=80 * 2**30 * 2), "catalog.cards[0]", "memory_bytes"),
    (lambda card: card.update(software_stack="metal"), "catalog.cards[0].software_stack", "cuda"),
])
def test_bad_cards_name_the_field(shipped, tmp_path, change, field, words):
    card = full_card(shipped, "h100", id="other-card", aliases=[])
    change(card)
    with pytest.raises(UserError) as err:
        load_catalog(write_catalog(tmp_path, {"cards": [card]}))
    assert err.value.field == field
    assert words in err.value.message


def test_missing_file_bad_yaml_and_wrong_shape(tmp_path):
    with pytest.raises(UserError) as err:
        load_catalog(tmp_path / "nope.yaml")
    assert err.value.field == "catalog" and "nope.yaml" in err.value.message
    bad = tmp_path / "bad.yaml"
    bad.write_text("cards:\n  - id: h100\n   pricing: [\n", encoding="utf-8")
    with pytest.raises(UserError) as err:
        load_catalog(bad)
    assert "not valid YAML at line" in err.value.message
    with pytest.raises(UserError) as err:
        load_catalog(write_catalog(tmp_path, ["h100"]))  # type: ignore[arg-type]
    assert "mapping" in err.value.message
    (tmp_path / "empty.yaml").write_text("", encoding="utf-8")
    with pytest.raises(UserError, match="is empty"):
        load_catalog(tmp_path / "empty.yaml")
    with pytest.raises(UserError) as err:
        load_catalog(write_catalog(tmp_path, {"schema_version": 2, "cards": [{"id": "h100"}]}))
    assert err.value.field == "catalog.schema_version"


def test_user_entries_need_ids_and_may_not_clash(shipped, tmp_path):
    with pytest.raises(UserError) as err:
        load_catalog(write_catalog(tmp_path, {"cards": [{"name": "no id"}]}))
    assert err.value.field == "catalog.cards[0].id"
    with pytest.raises(UserError) as err:
        load_catalog(write_catalog(tmp_path, {"cards": [{"id": "h100"}, {"id": "H100-SXM"}]}))
    assert err.value.field == "catalog.cards[1].id" and "both override" in err.value.message
    clash = full_card(shipped, "h100", id="my-h100", aliases=["h200"])
    with pytest.raises(UserError) as err:
        load_catalog(write_catalog(tmp_path, {"cards": [clash]}))
    assert "'h200' is used by both" in err.value.message


# --- cents -----------------------------------------------------------------------------------

def test_cents_conversion_is_exact():
    assert usd_to_cents(Decimal("2.49")) == 249
    assert usd_to_cents(Decimal("0")) == 0
    assert cents_to_usd(249) == Decimal("2.49") and str(cents_to_usd(5)) == "0.05"
    with pytest.raises(ValueError, match="whole number of cents"):
        usd_to_cents(Decimal("0.125"))
    assert usd_to_cents(Decimal("0.125"), rounding=ROUND_HALF_UP) == 13
    with pytest.raises(TypeError):
        usd_to_cents(2.49)  # type: ignore[arg-type]


@given(st.integers(min_value=0, max_value=10**12))
def test_two_decimal_strings_round_trip_through_cents(cents):
    text = f"{cents // 100}.{cents % 100:02d}"
    assert usd_to_cents(Decimal(text)) == cents
    assert str(cents_to_usd(cents)) == text
    assert usd_to_cents(cents_to_usd(cents)) == cents
