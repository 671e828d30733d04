"""The project's own prompt set for self-distilling draft models.

Every prompt is built here from templates and fillers written for specjax; no benchmark text is used (the
Spec-Bench questions are for evaluation only, and a test checks that none of them appears here). The set is
deterministic: the same list, in the same order, on every run, so a data file can be regenerated exactly.

Each filler is paired with one template of its category, rotating through the templates, which spreads the
phrasings evenly without building the full cross product.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Prompt:
    index: int  # position in the full list (stable across runs)
    category: str
    text: str


def _rotate(templates: list[str], fillers: list, key: str = "x") -> list[str]:
    """Filler i goes into template i mod len(templates); a filler may be a dict of several fields."""
    out = []
    for i, f in enumerate(fillers):
        fields = f if isinstance(f, dict) else {key: f}
        out.append(templates[i % len(templates)].format(**fields))
    return out


_EXPLAIN_T = [
    "Explain {x} in simple terms.",
    "Can you explain {x}?",
    "Teach me about {x}.",
    "Give a short explanation of {x} for a high-school student.",
    "Describe {x} in a few paragraphs.",
]
_EXPLAIN_X = [
    "photosynthesis", "the water cycle", "compound interest", "how vaccines train the immune system",
    "plate tectonics", "inflation", "the greenhouse effect", "how a refrigerator keeps food cold",
    "public-key cryptography", "supply and demand", "black holes", "how the internet routes data",
    "machine learning", "the difference between weather and climate", "DNA replication", "how batteries store energy",
    "the stock market", "natural selection", "how airplanes stay in the air", "the Pythagorean theorem",
    "recursion in programming", "how a search engine ranks pages", "the causes of the seasons",
    "what a hash table is", "how solar panels produce electricity", "the role of enzymes in digestion",
    "why the moon has phases", "how credit scores are calculated", "the basics of electric circuits",
    "how sound travels", "what an operating system does", "the scientific method", "how earthquakes are measured",
    "the function of the kidneys", "what a neural network is", "how tides are formed", "opportunity cost",
    "how GPS determines your location", "the difference between a virus and a bacterium", "how rainbows form",
    "why ice floats on water", "what a database index is", "how the heart pumps blood", "the law of conservation of energy",
]

_LIST_T = [
    "List five tips for {x}.",
    "What are some common mistakes people make when {x}?",
    "Give me a checklist for {x}.",
    "Name three advantages and three disadvantages of {x}.",
]
_LIST_X = [
    "learning a new language", "starting a vegetable garden", "preparing for a job interview", "working from home",
    "saving money on groceries", "training for a first 10 km run", "writing a clear email", "studying for exams",
    "keeping a houseplant alive", "traveling on a small budget", "public speaking", "organizing a small kitchen",
    "buying a used car", "taking better photos with a phone", "sleeping better", "learning to play the guitar",
    "living in a big city", "owning a dog", "electric cars", "online shopping", "reading more books",
    "planning a birthday party", "moving to a new apartment", "reducing screen time", "cooking for a large group",
    "remote team meetings", "riding a bicycle to work", "using a password manager",
]

_HOWTO_T = [
    "How can I {x}?",
    "Give me step-by-step instructions to {x}.",
    "What is the best way to {x}?",
]
_HOWTO_X = [
    "make a simple budget", "boil an egg perfectly", "change a flat bicycle tire", "back up my computer files",
    "write a cover letter", "learn to touch type", "clean a cast iron pan", "plan a weekly meal schedule",
    "set up a home network", "memorize a short speech", "brew pour-over coffee", "make friends in a new town",
    "start journaling", "negotiate a salary", "remove a coffee stain from a shirt", "teach a child to ride a bike",
    "improve my handwriting", "prepare for a long hike", "organize digital photos", "stay focused while studying",
]

_CODE_T = [
    "Write a Python function that {x}.",
    "Write a JavaScript function that {x}.",
    "Write a short Python program that {x}, with comments.",
    "How would you write code that {x}? Use Python.",
]
_CODE_X = [
    "reverses a string", "checks whether a number is prime", "returns the n-th Fibonacci number",
    "counts the vowels in a sentence", "removes duplicates from a list while keeping the order",
    "converts Celsius to Fahrenheit", "finds the largest element of a list", "checks if a word is a palindrome",
    "merges two sorted lists", "computes the factorial of a number", "counts how often each word appears in a text",
    "flattens a nested list", "validates an email address with a regular expression", "reads a CSV file and sums a column",
    "sorts a list of dictionaries by a key", "computes the average of a list of numbers", "implements binary search",
    "generates a random password", "transposes a matrix", "finds the greatest common divisor of two numbers",
    "capitalizes the first letter of every word", "checks whether two strings are anagrams",
    "returns the second smallest number in a list", "converts a decimal number to binary", "implements a stack class",
    "groups a list of words by their first letter", "computes the running sum of a list", "rotates a list by k positions",
]
_CODE_SNIPPETS = [
    "def f(xs):\n    return [x * x for x in xs if x % 2 == 0]",
    "def g(s):\n    return s == s[::-1]",
    "total = 0\nfor i in range(1, 11):\n    total += i\nprint(total)",
    "def h(n):\n    if n < 2:\n        return n\n    return h(n - 1) + h(n - 2)",
    "const add = (a, b) => a + b;\nconsole.log([1, 2, 3].reduce(add, 0));",
    "def count(text):\n    d = {}\n    for w in text.split():\n        d[w] = d.get(w, 0) + 1\n    return d",
    "def avg(xs):\n    return sum(xs) / len(xs)",
    "def last(xs):\n    return xs[len(xs)]",
    "def mean(xs):\n    s = 0\n    for x in xs:\n        s += x\n    return s / len(xs) - 1",
    "def is_even(n):\n    return n % 2 == 1",
]
_CODE_SNIPPET_T = [
    "Explain what this code does:\n\n{x}",
    "Is there a bug in this code? If so, fix it.\n\n{x}",
]

_WORD_PROBLEMS = [
    "A bakery sells muffins for {a} dollars each. If Tom buys {b} muffins and pays with a {c} dollar bill, how much change does he get?",
    "A train travels at {a} km per hour for {b} hours. How far does it go?",
    "Sara has {c} stickers. She gives {a} to her brother and {b} to her friend. How many stickers does she have left?",
    "A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
    "A class has {c} students and {a} of them walk to school. What percentage of the class walks to school?",
    "If {a} workers can paint a fence in {b} hours, how long would it take {c} workers at the same speed?",
    "A shirt costs {c} dollars and is on sale for {a} percent off. What is the sale price?",
    "Ben reads {a} pages every day. How many days does he need to finish a book with {c} pages?",
    "A garden has {a} rows of tomato plants with {b} plants in each row. How many tomato plants are there?",
    "The sum of two numbers is {c} and their difference is {a}. What are the two numbers?",
]
_NUMBERS = [(3, 4, 20), (5, 6, 50), (7, 3, 40), (12, 5, 90), (8, 9, 100), (6, 2, 30), (4, 7, 60), (9, 8, 120)]

_PASSAGES = [
    "The town of Millbrook opened its first public library in 1902. At first it held only a few hundred books, "
    "donated by local families. Over the next century the library grew into a community center with computer labs, "
    "reading programs for children and evening classes for adults. Today it welcomes more than a thousand visitors a week.",
    "Honeybees communicate the location of flowers through a movement called the waggle dance. The angle of the dance "
    "shows the direction relative to the sun, and its length signals the distance. Other bees watch the dance and then "
    "fly straight to the food source, which saves the colony time and energy.",
    "Remote work became common for many office jobs in the early 2020s. Workers reported saving time on commuting and "
    "enjoying more flexible schedules, while some companies worried about collaboration and team culture. Many "
    "organizations now use a hybrid model in which employees spend part of the week in the office.",
    "Our new kettle boils a full liter of water in under three minutes and switches itself off automatically. The handle "
    "stays cool, the water window is easy to read, and the base lets you place it in any direction. Customers say it is "
    "quiet, although a few wish the cord were longer.",
    "In the mountains of the north, farmers built stone terraces to grow crops on steep slopes. The terraces stop soil from "
    "washing away in heavy rain and hold water for longer. Some of these terraces are hundreds of years old and are still "
    "used by families who grow rice, beans and potatoes.",
    "The city council voted on Tuesday to add twelve kilometers of protected bike lanes over the next two years. Supporters "
    "argued that the lanes will make cycling safer and reduce traffic, while some shop owners worried about losing parking "
    "spaces. Construction is expected to begin in the spring.",
    "Sleep plays an important role in memory. During deep sleep, the brain replays and strengthens what was learned during "
    "the day. Studies show that students who sleep well after studying remember more than those who stay up late, even "
    "when they spend the same amount of time with their books.",
    "The museum's new exhibit shows everyday objects from a fishing village two hundred years ago: nets, lanterns, wooden "
    "bowls and handwritten letters. Visitors can listen to recordings of old songs and try on copies of traditional coats. "
    "The exhibit will stay open until the end of the year.",
]
_PASSAGE_T = [
    "Summarize the following text in two sentences:\n\n{x}",
    "What is the main idea of this paragraph?\n\n{x}",
    "Write a short headline for this text:\n\n{x}",
    "Turn this text into three bullet points:\n\n{x}",
    "Write two questions that can be answered from this text:\n\n{x}",
]

_SENTENCES = [
    "The weather is lovely today, so we are going to the park.",
    "Could you tell me where the train station is?",
    "I would like to book a table for four people at seven o'clock.",
    "My sister is learning to play the piano.",
    "The meeting has been moved to next Thursday afternoon.",
    "Please remember to turn off the lights when you leave.",
    "We visited an old castle near the river last summer.",
    "This soup needs a little more salt.",
    "How long does it take to walk to the museum?",
    "Reading before bed helps me relax.",
    "The shop closes at six, so we should hurry.",
    "Thank you very much for your help with the project.",
]
_LANGUAGES = ["French", "Spanish", "German", "Italian", "Portuguese", "Dutch"]

_REWRITE_T = [
    "Rewrite this sentence so it sounds more formal: {x}",
    "Make this sentence simpler and shorter: {x}",
    "Rewrite this sentence in the passive voice: {x}",
    "Paraphrase the following sentence: {x}",
]
_REWRITE_X = [
    "Hey, can you send me that report thing by tomorrow?",
    "The committee, after a lengthy period of deliberation, ultimately arrived at the decision to postpone the event.",
    "The chef prepared a wonderful meal for all the guests.",
    "We gotta fix this bug before the demo or we're in trouble.",
    "The students finished the science project two days early.",
    "In light of the fact that it was raining heavily, the game was called off.",
    "The manager approved the new vacation policy last week.",
    "I think maybe we should probably consider looking at other options.",
    "The storm knocked down several trees in the neighborhood.",
    "Our team has made significant progress on the new website design.",
]
_GRAMMAR_X = [
    "Me and him goes to the store every days.",
    "She don't like apples, but she like oranges.",
    "Their going to the park tomorrow if it dont rain.",
    "The childs was playing in the garden all afternoon.",
    "I have saw that movie three times already.",
    "Each of the students have their own book.",
]

_QA = [
    "Why is the sky blue?", "What causes thunder?", "How many bones are in the adult human body?",
    "What is the largest planet in our solar system?", "Who wrote the play Romeo and Juliet?",
    "What is the boiling point of water at sea level in Fahrenheit?", "Why do leaves change color in autumn?",
    "What is the difference between a fruit and a vegetable?", "How do bees make honey?",
    "What language has the most native speakers?", "Why do we have leap years?", "What is the speed of light?",
    "How far is the Moon from the Earth?", "What are the three states of matter?", "Why do cats purr?",
    "What is the tallest mountain in the world?", "What does a CPU do?", "Why is the ocean salty?",
    "What is the smallest prime number?", "How do plants get water from their roots to their leaves?",
    "What is the main gas in the Earth's atmosphere?", "Why do onions make people cry?",
    "What is the difference between an alligator and a crocodile?", "How long does light from the Sun take to reach Earth?",
    "What is a prime number?", "Why do we yawn?", "What is the capital of Australia?", "What is an atom made of?",
    "Why does bread rise?", "What is the purpose of a comma in a sentence?",
]

_EXTRACT_TEXTS = [
    "On March 3, 2021, Dana Whitfield opened a bakery called Golden Crust on Elm Street. Her brother Marcus joined "
    "her in June, and by December they had hired four more people.",
    "The conference will take place in Lisbon from 14 to 16 October. Speakers include Dr. Priya Raman, Tomas Berg and "
    "Lena Okafor. Tickets cost 250 euros before September 1 and 320 euros afterwards.",
    "Order #4471: 2 notebooks at $3.50 each, 1 stapler at $8.99, 5 pens at $1.20 each. Ship to Ana Ruiz, "
    "18 Harbor Road, Portland. Requested delivery date: May 9.",
    "Captain Elise Moreau sailed from Marseille on 2 April with a crew of nineteen. After stops in Tunis and Malta, "
    "the ship reached Athens on 20 April, three days later than planned because of a storm.",
    "The survey asked 1,200 adults about their commute. 46 percent drive, 31 percent take public transit, 15 percent "
    "walk and 8 percent cycle. The average commute lasted 27 minutes.",
]
_EXTRACT_T = [
    "Extract all the names and dates from this text:\n\n{x}",
    "List every number that appears in this text and what it refers to:\n\n{x}",
    "Convert the key facts in this text into a JSON object:\n\n{x}",
]

_CREATIVE_T = [
    "Write a short poem about {x}.",
    "Write a short story about {x}.",
    "Write a haiku about {x}.",
    "Write a limerick about {x}.",
    "Write a children's story opening about {x}.",
]
_CREATIVE_X = [
    "a lighthouse keeper", "the first snowfall of winter", "a robot learning to paint", "a lost umbrella",
    "an old oak tree", "a cat who wants to fly", "the night sky over the desert", "a busy train station",
    "a dragon who is afraid of the dark", "the smell of rain", "a child's first day at school", "a sunflower field",
    "a friendship between a fox and a crow", "an empty playground at dusk", "a message in a bottle", "morning coffee",
    "a city after a storm", "a forgotten key", "a mountain village", "the last day of summer",
]

_WRITE_T = [
    "Write a short email to {x}.",
    "Write a product description for {x}.",
    "Write a friendly social media post announcing {x}.",
]
_WRITE_X = [
    "my landlord asking to fix a leaking tap", "a reusable water bottle that keeps drinks cold for a day",
    "the opening of a new neighborhood bakery", "a colleague thanking them for their help",
    "a lightweight hiking backpack", "a community clean-up day in the park", "a teacher asking about a missed homework deadline",
    "a wooden puzzle game for children", "the launch of a local book club", "a customer apologizing for a late delivery",
    "a solar-powered phone charger", "a free coding workshop for beginners",
]

_COMPARE = [
    ("cats", "dogs as pets"), ("trains", "planes for travel in Europe"), ("Python", "JavaScript"),
    ("renting", "buying a home"), ("e-books", "paper books"), ("tea", "coffee"), ("solar power", "wind power"),
    ("running", "swimming for fitness"), ("city life", "country life"), ("laptops", "desktop computers"),
    ("lists", "tuples in Python"), ("mitosis", "meiosis"),
]
_COMPARE_T = ["Compare {a} and {b}.", "What are the main differences between {a} and {b}?"]

_REVIEWS = [
    "The battery lasts all day and the screen is bright, but the speaker is weak.",
    "Terrible service. We waited an hour and the food was cold.",
    "Absolutely loved this book, I could not put it down!",
    "The hotel room was clean, although the street outside was noisy at night.",
    "It broke after two days. Do not buy this.",
    "Great value for the price and it arrived early.",
]
_REVIEW_T = [
    "Is the following review positive, negative or mixed? Explain briefly.\n\n{x}",
    "Classify the sentiment of this review and list the points it mentions:\n\n{x}",
]

_REASONING = [
    "If all bloops are razzies and all razzies are lazzies, are all bloops lazzies? Explain.",
    "Anna is taller than Ben, and Ben is taller than Carl. Who is the shortest?",
    "A farmer has chickens and cows. There are 10 heads and 28 legs. How many of each animal are there?",
    "What comes next in the sequence 2, 6, 12, 20, 30?",
    "If today is Wednesday, what day of the week will it be in 10 days?",
    "A box contains 3 red balls and 5 blue balls. If you pick one at random, what is the probability it is red?",
    "Three friends share a pizza cut into 12 slices equally. Then one friend gives half of his slices away. How many slices does he have left?",
    "Is the statement 'every square is a rectangle' true or false? Why?",
    "If it takes 5 minutes to boil one egg, how long does it take to boil 4 eggs in the same pot?",
    "Which is heavier, a kilogram of feathers or a kilogram of iron?",
]

_DEFINE_T = ["Define the word '{x}' and use it in a sentence.", "What does '{x}' mean? Give two examples."]
_DEFINE_X = ["resilient", "ambiguous", "meticulous", "serendipity", "ephemeral", "pragmatic", "benevolent", "candid"]


def build_prompts() -> list[Prompt]:
    """The full deterministic prompt list (a few hundred prompts over many task types)."""
    groups: list[tuple[str, list[str]]] = [
        ("explain", _rotate(_EXPLAIN_T, _EXPLAIN_X)),
        ("list", _rotate(_LIST_T, _LIST_X)),
        ("howto", _rotate(_HOWTO_T, _HOWTO_X)),
        ("code", _rotate(_CODE_T, _CODE_X)),
        ("code_read", [t.format(x=s) for s in _CODE_SNIPPETS for t in _CODE_SNIPPET_T]),
        ("math", [p.format(a=a, b=b, c=c) for i, p in enumerate(_WORD_PROBLEMS)
                  for a, b, c in (_NUMBERS[i % len(_NUMBERS)], _NUMBERS[(i + 3) % len(_NUMBERS)])]),
        ("summarize", [t.format(x=p) for j, p in enumerate(_PASSAGES)
                       for t in (_PASSAGE_T[j % len(_PASSAGE_T)], _PASSAGE_T[(j + 2) % len(_PASSAGE_T)])]),
        ("translate", [f"Translate into {_LANGUAGES[(i + k) % len(_LANGUAGES)]}: {s}"
                       for i, s in enumerate(_SENTENCES) for k in (0, 3)]),
        ("rewrite", _rotate(_REWRITE_T, _REWRITE_X)
         + [f"Correct the grammar in this sentence: {s}" for s in _GRAMMAR_X]),
        ("qa", list(_QA)),
        ("extract", [t.format(x=x) for x in _EXTRACT_TEXTS for t in _EXTRACT_T]),
        ("creative", _rotate(_CREATIVE_T, _CREATIVE_X)),
        ("write", _rotate(_WRITE_T, _WRITE_X)),
        ("compare", _rotate(_COMPARE_T, [{"a": a, "b": b} for a, b in _COMPARE])),
        ("classify", [t.format(x=r) for i, r in enumerate(_REVIEWS) for t in (_REVIEW_T[i % 2],)]),
        ("reasoning", list(_REASONING)),
        ("define", _rotate(_DEFINE_T, _DEFINE_X)),
    ]
    prompts: list[Prompt] = []
    for category, texts in groups:
        for text in texts:
            prompts.append(Prompt(len(prompts), category, text))
    return prompts


def is_heldout(index: int, every: int = 10) -> bool:
    """The evaluation split: every `every`-th prompt (offset so each category contributes)."""
    return index % every == every // 2
