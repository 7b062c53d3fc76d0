from bertforge.pipelines.instances.sentences import split_paragraphs, split_sentences


def test_splits_sentences_and_knows_abbreviations():
    text = "Dr. Smith went to Washington. He arrived at 5 p.m. on Monday! Was it late? Yes."
    assert split_sentences(text) == [
        "Dr. Smith went to Washington.",
        "He arrived at 5 p.m. on Monday!",
        "Was it late?",
        "Yes.",
    ]


def test_paragraph_breaks_are_sentence_breaks():
    text = "Introduction\n\nThe first paragraph has no full stop\n \n\nA second one.  It ends."
    assert split_sentences(text) == [
        "Introduction",
        "The first paragraph has no full stop",
        "A second one.",
        "It ends.",
    ]


def test_wrapped_lines_inside_a_paragraph_are_joined():
    text = "This sentence is wrapped\nover two lines. And this\none too."
    assert split_sentences(text) == [
        "This sentence is wrapped over two lines.",
        "And this one too.",
    ]


def test_empty_and_whitespace_give_nothing():
    assert split_sentences("") == []
    assert split_sentences(" \n\n \t\n") == []
    assert split_paragraphs("a\n \nb") == ["a", "b"]
