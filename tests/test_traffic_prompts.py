"""Traffic prompts (scripts/traffic_prompts.py): one source language's sentences from installed packages' catalogs
(Django's ``locale/`` and Plone's ``locales/`` layouts) and German ShareGPT paragraphs cut into sentences; news
reports from gensim's test data, read in its cp1252 bytes; retrieval-augmented prompts over the Wikipedia sample
there (section prose cut into passages, references and non-prose sections dropped); math word problems from
ShareGPT and worded problems from mathgenerator's generators, seeded; bad flags refused before any work."""

import bz2
import json
import random
import sys

import pytest

from tokenmaxx.scripts import traffic_prompts

from test_text_mix import write_mo

GERMAN_PARA = ("Die Stadt hat einen neuen Plan für den Verkehr beschlossen. Der Bürgermeister sagte, dass die "
               "Straßen im Zentrum nicht mehr für Autos offen sind. Das ist auch eine Frage der Sicherheit für die "
               "Kinder.")


def words(tag, n):
    return " ".join(f"{tag}{i}" for i in range(n))


def page(title, text):
    return f'<page><title>{title}</title><ns>0</ns><revision><text xml:space="preserve">{text}</text></revision></page>'


def wiki_dump():
    """Three articles as a MediaWiki export holds them (its namespace, escaped wikitext), and a redirect."""
    alaska = ("'''Alaska''' is a [[U.S. state|state]]. " + words("lead", 130) + "&lt;ref&gt;Cited, p. 1&lt;/ref&gt;"
              "\n\nShort line.\n\n== History ==\n" + words("hist", 100) + "\n\n=== CEO Era ===\n" + words("era", 60)
              + "\n\n== References ==\n" + words("refs", 100))
    pages = [page("Alaska", alaska), page("Aruba", words("aruba", 200)), page("Albedo", words("albedo", 100)),
             page("AlaskaHistory", "#REDIRECT [[Alaska]]")]
    return '<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/">' + "".join(pages) + "</mediawiki>"


@pytest.fixture
def packages(tmp_path, monkeypatch):
    roots = {"djangoish": tmp_path / "djangoish", "ploneish": tmp_path / "ploneish"}
    write_mo(roots["djangoish"] / "conf" / "locale" / "de" / "LC_MESSAGES" / "django.mo",
             {"Please correct the errors below.": "Bitte korrigieren Sie die unten aufgeführten Fehler.",
              "Save": "Sichern", "%(n)s items were changed.": "%(n)s Objekte wurden geändert."})
    write_mo(roots["ploneish"] / "locales" / "de" / "LC_MESSAGES" / "plone.mo",
             {"You are not allowed to change the address.": "Sie dürfen die Adresse leider nicht ändern.",
              "Le document a été publié.": "x"})
    write_mo(roots["ploneish"] / "locales" / "fr" / "LC_MESSAGES" / "plone.mo",
             {"The page was saved in the folder.": "La page a été enregistrée dans le dossier."})
    news = tmp_path / "gensimish" / "test" / "test_data"
    news.mkdir(parents=True)
    (news / "lee_background.cor").write_bytes("Prices rose by \u00a35 today.\n\n".encode("cp1252")
                                              + b"Second   report here.\n")
    (news / "lee.cor").write_bytes(b"Third report.\n")
    (news / traffic_prompts.WIKI_FILE).write_bytes(bz2.compress(wiki_dump().encode()))
    found = {"gensim": tmp_path / "gensimish", **roots}
    monkeypatch.setattr(traffic_prompts, "package_root", lambda name, why: found[name])
    monkeypatch.setattr(traffic_prompts, "_paragraphs", lambda roles: iter([GERMAN_PARA, "Too short und der."]))
    return roots


def test_one_language_from_both_catalog_layouts_and_german_sentences(packages):
    texts = traffic_prompts.translate_texts(["djangoish", "ploneish"], "German")
    assert "Translate German to English: Bitte korrigieren Sie die unten aufgeführten Fehler." in texts
    assert "Translate German to English: Sie dürfen die Adresse leider nicht ändern." in texts  # locales/ (Plone)
    assert "Translate German to English: Sichern" not in texts  # under 5 words
    assert not any("%(n)s" in t or "French" in t for t in texts)  # placeholders, other languages
    assert f"Translate German to English: {GERMAN_PARA}" in texts  # the paragraph, and each sentence of it
    assert "Translate German to English: Das ist auch eine Frage der Sicherheit für die Kinder." in texts
    assert len([t for t in texts if "Bürgermeister" in t]) == 2
    every = traffic_prompts.translate_texts(["ploneish"])
    assert "Translate French to English: La page a été enregistrée dans le dossier." in every


def test_news_passages_are_gensims_reports(packages):
    assert traffic_prompts.news_passages() == ["Prices rose by \u00a35 today.", "Second report here.", "Third report."]
    texts = traffic_prompts.summarize_texts(random.Random(0), "news")
    assert len(texts) == 3 and all(t.split("\n\n")[0] in traffic_prompts.SUMMARY_ASKS for t in texts)


def test_cli_writes_seeded_prompts_and_refuses_bad_flags(packages, tmp_path, capsys):
    out = tmp_path / "p.jsonl"
    argv = ["--shape", "summarize", "--source", "news", "--count", "2", "--out", str(out)]
    assert traffic_prompts.main(argv) == 0
    first = out.read_text()
    assert traffic_prompts.main(argv) == 0 and out.read_text() == first and len(first.splitlines()) == 2
    assert all("prompt" in json.loads(line) for line in first.splitlines())
    for bad, words in ((["--language", "Klingon"], "--language must be one of"),
                       (["--source", "rss"], "--source must be one of")):
        with pytest.raises(SystemExit):
            traffic_prompts.main([*argv, *bad])
        assert words in capsys.readouterr().err
    with pytest.raises(ValueError, match="only 3 summarize prompts are available"):
        traffic_prompts.main([*argv, "--count", "9"])  # the last --count wins


def test_questions_are_short_standalone_openers(monkeypatch):
    def turn(text, who="human"):
        return {"conversations": [{"from": who, "value": text}, {"from": "gpt", "value": "An answer."}]}
    records = [turn("Who composed the tune of   Twinkle, Twinkle, Little Star?"), turn("What is the capital of Peru?"),
               turn("Can you explain step 3 of this?"),  # refers to an earlier turn
               turn("What is it?"),  # too short, and refers back
               turn("Why? And how?"), turn("Tell me about Peru."), turn("What is a monad?", who="gpt"),
               {"conversations": []}]
    monkeypatch.setattr(traffic_prompts, "read_json_array", lambda path: iter(records))
    monkeypatch.setattr(traffic_prompts, "sharegpt_path", lambda: "sharegpt.json")
    assert traffic_prompts.question_texts() == ["What is the capital of Peru?",
                                                "Who composed the tune of Twinkle, Twinkle, Little Star?"]


def test_wiki_passages_are_section_prose_cut_into_pieces(packages):
    passages = traffic_prompts.wiki_passages()
    alaska = [(heading, text) for title, heading, text in passages if title == "Alaska"]
    # the lead's 134 words: 100 and a last 34 under half a passage, dropped; "Short line." is no paragraph
    assert [(heading, len(text.split())) for heading, text in alaska] == [(None, 100), ("History", 100),
                                                                           ("CEO Era", 60)]
    assert alaska[0][1].startswith("Alaska is a state. lead0") and "Cited" not in alaska[0][1]  # references dropped
    assert not any("refs0" in text for *_, text in passages)  # the References section
    assert [title for title, *_ in passages].count("Aruba") == 2  # 200 words: two passages
    assert {title for title, *_ in passages} == {"Alaska", "Aruba", "Albedo"}  # the redirect gives none


def test_rag_prompts_put_the_asked_passage_among_its_articles_and_others(packages, monkeypatch):
    monkeypatch.setattr(traffic_prompts, "RAG_OWN", 1)
    monkeypatch.setattr(traffic_prompts, "RAG_OTHERS", 1)
    passages = traffic_prompts.wiki_passages()
    texts = traffic_prompts.rag_texts(random.Random(0))
    assert len(texts) == 5  # Albedo's one passage has no other of its article: no prompt
    for text in texts:
        *lines, question = text.split("\n")
        assert len(lines) == 3 and all(any(line == f"{t} {body}" for t, _, body in passages) for line in lines)
        assert question.endswith(("?", ".")) and question.split()[-1].rstrip("?.") in {"Alaska", "Aruba"}
    eras = [t for t in texts if "the CEO Era of Alaska" in t.split("\n")[-1]]  # acronyms keep their capitals
    history = [t for t in texts if "the history of Alaska" in t.split("\n")[-1]]
    assert len(eras) == 1 and "era0" in eras[0] and len(history) == 1 and "hist0" in history[0]


def test_math_prompts_are_word_problems_and_worded_generator_problems(monkeypatch):
    def turn(text, who="human"):
        return {"conversations": [{"from": who, "value": text}]}
    records = [turn("Tom buys 4 boxes with 12 pencils in each box. How many pencils does he have in total?"),
               turn("Sam earns 30 dollars a day for 5 days. How much does he earn altogether, in   total?"),
               turn("How many ways are there?"),  # too short, one number at most
               turn("Write a loop `for i in range(10)` and tell me how many times it runs, from 1 to 10."),  # code
               turn("A train goes 60 km in 2 hours. How far does it go per hour?", who="gpt"),  # not a user's
               turn("I have 3 apples and 5 pears on 2 plates. Tell me a story about them, please.")]  # nothing asked
    monkeypatch.setattr(traffic_prompts, "read_json_array", lambda path: iter(records))
    monkeypatch.setattr(traffic_prompts, "sharegpt_path", lambda: "sharegpt.json")
    assert traffic_prompts.word_problem_texts() == [
        "Sam earns 30 dollars a day for 5 days. How much does he earn altogether, in total?",
        "Tom buys 4 boxes with 12 pencils in each box. How many pencils does he have in total?"]

    def worded(rng):
        return f"Volume of a cube with side ${rng.randint(1, 99)}$ m is", None

    def formula(rng):
        return f"${rng.randint(1, 99)} + {rng.randint(1, 99)} = $", None  # no words: never a prompt

    def fixed(rng):
        return "The Fibonacci Series of the first ${n}$ numbers is ?", None  # one text only: dropped

    def broken(rng):
        if rng.random() < 0.5:
            raise IndexError("string index out of range")
        return f"Find the prime factors of the number ${rng.randint(100, 999)}$ please", None

    gens = [worded, formula, fixed, broken]
    fake = type(sys)("mathgenerator")
    fake.getGenList = lambda: [[i, f.__name__] for i, f in enumerate(gens)]
    fake.genById = lambda i: gens[i](random)  # draws from the module's random, as mathgenerator does
    monkeypatch.setitem(sys.modules, "mathgenerator", fake)
    random.seed(123)
    after_seed = random.random()
    random.seed(123)
    texts = traffic_prompts.generated_math_texts(seed=7, draws=5)
    assert random.random() == after_seed  # the caller's random state is left as it was
    assert texts == traffic_prompts.generated_math_texts(seed=7, draws=5)  # seeded
    assert len(texts) == 10 and len(set(texts)) == 10
    assert sum(t.startswith("Volume of a cube") for t in texts) == 5 and sum("prime factors" in t for t in texts) == 5
    monkeypatch.setitem(sys.modules, "mathgenerator", None)  # not installed
    with pytest.raises(ValueError, match="pip install mathgenerator"):
        traffic_prompts.generated_math_texts(seed=7)
