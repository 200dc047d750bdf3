"""Generate sample_data/code_alpaca_sample.jsonl: short Python tasks whose answers are run and checked.

    python sample_data/make_sample_data.py            # rewrites the JSONL beside this script

The rows follow Code Alpaca's layout (instruction / input / output / split, split 0 train, 1 validation,
2 test). Two kinds of rows:

- "Write a function ..." with an empty input: the answer defines the function; it is checked by
  calling it on test cases and comparing with a reference implementation.
- "... the given list/string" with a concrete input: the answer defines the function, binds the input
  and prints the result; it is checked by running it and comparing what it prints.

A row is written only after its check passes, and the output is the same on every run (seeded).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SEED = 1234
OUTPUT = Path(__file__).resolve().parent / "code_alpaca_sample.jsonl"
INSTANCES_PER_TASK = 8
SPLIT_SHARES = (0.8, 0.1, 0.1)

WORDS = ["apple", "river", "stone", "level", "planet", "garden", "silver", "rotor", "window", "python",
         "kayak", "orange", "music", "cloud", "tiger", "noon", "listen", "silent", "paper", "forest"]


@dataclass
class Task:
    """One kind of exercise: how to ask it, reference behaviour, accepted solutions, sample inputs."""

    func: str
    """Name of the function every solution defines."""
    params: tuple[str, ...]
    """Parameter names, also the variable names bound in the instance snippets."""
    asks: tuple[str, ...]
    """Instructions for the function-only rows (input empty); one row each."""
    instance_asks: tuple[str, ...]
    """Instructions for rows with a concrete input."""
    solutions: tuple[str, ...]
    """Function definitions; rows cycle through them so answers vary in style."""
    reference: Callable[..., Any]
    make_args: Callable[[random.Random], tuple]


def _nums(rng: random.Random, low: int = -20, high: int = 60, size: tuple[int, int] = (2, 7)) -> list[int]:
    return [rng.randint(low, high) for _ in range(rng.randint(*size))]


def _sentence(rng: random.Random) -> str:
    return " ".join(rng.sample(WORDS, rng.randint(2, 5)))


def _is_prime(n: int) -> bool:
    return n >= 2 and all(n % d for d in range(2, int(n**0.5) + 1))


def _fib(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


def _fizzbuzz(n: int) -> str:
    return "FizzBuzz" if n % 15 == 0 else "Fizz" if n % 3 == 0 else "Buzz" if n % 5 == 0 else str(n)


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


TASKS: list[Task] = [
    Task("sum_list", ("numbers",),
         ("Write a function that returns the sum of a list of numbers.",
          "Create a Python function to add up all the numbers in a list.",
          "Implement a function that computes the total of a list of integers."),
         ("Compute the sum of the given list of numbers.", "Print the total of the numbers in the given list."),
         ("def sum_list(numbers):\n    total = 0\n    for n in numbers:\n        total += n\n    return total",
          "def sum_list(numbers):\n    return sum(numbers)"),
         lambda xs: sum(xs), lambda rng: (_nums(rng),)),
    Task("product", ("numbers",),
         ("Write a function that returns the product of all numbers in a list.",
          "Create a function to multiply together every element of a list.",
          "Implement a Python function that computes the product of a list of integers."),
         ("Compute the product of the given list of numbers.", "Multiply all the numbers in the given list."),
         ("def product(numbers):\n    result = 1\n    for n in numbers:\n        result *= n\n    return result",
          "import math\n\n\ndef product(numbers):\n    return math.prod(numbers)"),
         lambda xs: __import__("math").prod(xs), lambda rng: (_nums(rng, -5, 9, (2, 5)),)),
    Task("find_max", ("numbers",),
         ("Write a function that returns the largest number in a list.",
          "Create a function to find the maximum value in a list without using max().",
          "Implement a function that finds the biggest element of a list of numbers."),
         ("Find the largest number in the given list.", "Print the maximum of the given list."),
         ("def find_max(numbers):\n    largest = numbers[0]\n    for n in numbers[1:]:\n        if n > largest:\n"
          "            largest = n\n    return largest",
          "def find_max(numbers):\n    largest = numbers[0]\n    for n in numbers:\n        largest = n if n > largest "
          "else largest\n    return largest"),
         lambda xs: max(xs), lambda rng: (_nums(rng),)),
    Task("find_min", ("numbers",),
         ("Write a function that returns the smallest number in a list.",
          "Create a function to find the minimum value in a list.",
          "Implement a function that returns the lowest element of a list of numbers."),
         ("Find the smallest number in the given list.", "Print the minimum of the given list."),
         ("def find_min(numbers):\n    smallest = numbers[0]\n    for n in numbers[1:]:\n        if n < smallest:\n"
          "            smallest = n\n    return smallest",
          "def find_min(numbers):\n    return min(numbers)"),
         lambda xs: min(xs), lambda rng: (_nums(rng),)),
    Task("average", ("numbers",),
         ("Write a function that returns the average of a list of numbers, rounded to 2 decimals.",
          "Create a function to compute the mean of a list, rounded to two decimal places.",
          "Implement a function that calculates the arithmetic mean of a list of numbers (2 decimals)."),
         ("Compute the average of the given numbers, rounded to 2 decimals.",
          "Print the mean of the given list, rounded to two decimal places."),
         ("def average(numbers):\n    return round(sum(numbers) / len(numbers), 2)",
          "def average(numbers):\n    total = 0\n    for n in numbers:\n        total += n\n"
          "    return round(total / len(numbers), 2)"),
         lambda xs: round(sum(xs) / len(xs), 2), lambda rng: (_nums(rng, 0, 100),)),
    Task("count_even", ("numbers",),
         ("Write a function that counts the even numbers in a list.",
          "Create a function that returns how many elements of a list are even.",
          "Implement a function to count the even integers in a list."),
         ("Count the even numbers in the given list.", "How many even numbers does the given list contain?"),
         ("def count_even(numbers):\n    return sum(1 for n in numbers if n % 2 == 0)",
          "def count_even(numbers):\n    count = 0\n    for n in numbers:\n        if n % 2 == 0:\n"
          "            count += 1\n    return count"),
         lambda xs: sum(1 for x in xs if x % 2 == 0), lambda rng: (_nums(rng, 0, 50, (3, 8)),)),
    Task("filter_even", ("numbers",),
         ("Write a function that returns only the even numbers of a list.",
          "Create a function to keep the even elements of a list and drop the odd ones.",
          "Implement a function that filters a list down to its even numbers."),
         ("Keep only the even numbers of the given list.", "Filter the given list to its even numbers."),
         ("def filter_even(numbers):\n    return [n for n in numbers if n % 2 == 0]",
          "def filter_even(numbers):\n    result = []\n    for n in numbers:\n        if n % 2 == 0:\n"
          "            result.append(n)\n    return result"),
         lambda xs: [x for x in xs if x % 2 == 0], lambda rng: (_nums(rng, 0, 50, (3, 8)),)),
    Task("square_all", ("numbers",),
         ("Write a function that squares every number in a list.",
          "Create a function that returns a new list with each element squared.",
          "Implement a function to compute the squares of a list of numbers."),
         ("Square every number in the given list.", "Return the squares of the given numbers."),
         ("def square_all(numbers):\n    return [n * n for n in numbers]",
          "def square_all(numbers):\n    return list(map(lambda n: n ** 2, numbers))"),
         lambda xs: [x * x for x in xs], lambda rng: (_nums(rng, -9, 12),)),
    Task("reverse_string", ("text",),
         ("Write a function that reverses a string.",
          "Create a function to return a string with its characters in reverse order.",
          "Implement a Python function that reverses the text it is given."),
         ("Reverse the given string.", "Print the given text backwards."),
         ("def reverse_string(text):\n    return text[::-1]",
          "def reverse_string(text):\n    return \"\".join(reversed(text))"),
         lambda s: s[::-1], lambda rng: (_sentence(rng),)),
    Task("is_palindrome", ("text",),
         ("Write a function that checks whether a string is a palindrome, ignoring case and spaces.",
          "Create a function to tell if a word reads the same forwards and backwards.",
          "Implement a palindrome check that ignores spaces and letter case."),
         ("Check whether the given text is a palindrome.", "Is the given word a palindrome?"),
         ("def is_palindrome(text):\n    cleaned = text.replace(\" \", \"\").lower()\n"
          "    return cleaned == cleaned[::-1]",
          "def is_palindrome(text):\n    chars = [c.lower() for c in text if c != \" \"]\n"
          "    return chars == chars[::-1]"),
         lambda s: s.replace(" ", "").lower() == s.replace(" ", "").lower()[::-1],
         lambda rng: (rng.choice(WORDS).capitalize(),)),
    Task("count_vowels", ("text",),
         ("Write a function that counts the vowels in a string.",
          "Create a function that returns how many vowels (a, e, i, o, u) a text contains.",
          "Implement a function to count the vowels in a sentence, ignoring case."),
         ("Count the vowels in the given text.", "How many vowels are in the given sentence?"),
         ("def count_vowels(text):\n    return sum(1 for c in text.lower() if c in \"aeiou\")",
          "def count_vowels(text):\n    count = 0\n    for c in text.lower():\n        if c in \"aeiou\":\n"
          "            count += 1\n    return count"),
         lambda s: sum(1 for c in s.lower() if c in "aeiou"), lambda rng: (_sentence(rng),)),
    Task("capitalize_words", ("text",),
         ("Write a function that capitalizes the first letter of every word in a sentence.",
          "Create a function to convert a sentence to title case.",
          "Implement a function that upper-cases the first letter of each word."),
         ("Capitalize every word of the given sentence.", "Convert the given text to title case."),
         ("def capitalize_words(text):\n    return \" \".join(w.capitalize() for w in text.split())",
          "def capitalize_words(text):\n    words = []\n    for w in text.split():\n"
          "        words.append(w[0].upper() + w[1:])\n    return \" \".join(words)"),
         lambda s: " ".join(w.capitalize() for w in s.split()), lambda rng: (_sentence(rng),)),
    Task("factorial", ("n",),
         ("Write a function that returns the factorial of n.",
          "Create a recursive function to compute n!.",
          "Implement an iterative factorial function."),
         ("Compute the factorial of the given number.", "Print n! for the given n."),
         ("def factorial(n):\n    if n <= 1:\n        return 1\n    return n * factorial(n - 1)",
          "def factorial(n):\n    result = 1\n    for i in range(2, n + 1):\n        result *= i\n    return result"),
         lambda n: __import__("math").factorial(n), lambda rng: (rng.randint(0, 12),)),
    Task("fibonacci", ("n",),
         ("Write a function that returns the n-th Fibonacci number (fibonacci(0) is 0).",
          "Create a function to compute the nth Fibonacci number iteratively.",
          "Implement a function returning Fibonacci number n, starting from 0 and 1."),
         ("Compute the n-th Fibonacci number for the given n.", "Print the Fibonacci number at the given index."),
         ("def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a",
          "def fibonacci(n):\n    if n < 2:\n        return n\n    prev, cur = 0, 1\n    for _ in range(n - 1):\n"
          "        prev, cur = cur, prev + cur\n    return cur"),
         _fib, lambda rng: (rng.randint(0, 25),)),
    Task("is_prime", ("n",),
         ("Write a function that checks whether a number is prime.",
          "Create a function that returns True if n is a prime number.",
          "Implement a primality test by trial division."),
         ("Check whether the given number is prime.", "Is the given number a prime?"),
         ("def is_prime(n):\n    if n < 2:\n        return False\n    for d in range(2, int(n ** 0.5) + 1):\n"
          "        if n % d == 0:\n            return False\n    return True",
          "def is_prime(n):\n    return n >= 2 and all(n % d for d in range(2, int(n ** 0.5) + 1))"),
         _is_prime, lambda rng: (rng.randint(0, 120),)),
    Task("gcd", ("a", "b"),
         ("Write a function that returns the greatest common divisor of two numbers.",
          "Create a function implementing Euclid's algorithm for the GCD.",
          "Implement a function to find the largest number dividing both a and b."),
         ("Find the greatest common divisor of the given numbers.", "Compute the GCD of the two given numbers."),
         ("def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return a",
          "def gcd(a, b):\n    if b == 0:\n        return a\n    return gcd(b, a % b)"),
         _gcd, lambda rng: (rng.randint(1, 20) * rng.randint(1, 12), rng.randint(1, 20) * rng.randint(1, 12))),
    Task("celsius_to_fahrenheit", ("celsius",),
         ("Write a function that converts a temperature from Celsius to Fahrenheit.",
          "Create a function to turn degrees Celsius into degrees Fahrenheit.",
          "Implement a Celsius to Fahrenheit conversion function."),
         ("Convert the given Celsius temperature to Fahrenheit.", "What is the given temperature in Fahrenheit?"),
         ("def celsius_to_fahrenheit(celsius):\n    return round(celsius * 9 / 5 + 32, 1)",
          "def celsius_to_fahrenheit(celsius):\n    fahrenheit = celsius * 1.8 + 32\n    return round(fahrenheit, 1)"),
         lambda c: round(c * 9 / 5 + 32, 1), lambda rng: (rng.randint(-30, 45),)),
    Task("remove_duplicates", ("items",),
         ("Write a function that removes duplicates from a list while keeping the original order.",
          "Create a function returning the unique elements of a list in first-seen order.",
          "Implement a function to drop repeated items from a list, preserving order."),
         ("Remove the duplicates from the given list, keeping the order.", "Deduplicate the given list."),
         ("def remove_duplicates(items):\n    seen = set()\n    result = []\n    for item in items:\n"
          "        if item not in seen:\n            seen.add(item)\n            result.append(item)\n"
          "    return result",
          "def remove_duplicates(items):\n    return list(dict.fromkeys(items))"),
         lambda xs: list(dict.fromkeys(xs)), lambda rng: (_nums(rng, 1, 6, (4, 9)),)),
    Task("sort_descending", ("numbers",),
         ("Write a function that sorts a list of numbers from largest to smallest.",
          "Create a function to sort a list in descending order.",
          "Implement a function returning a list sorted in reverse numerical order."),
         ("Sort the given list in descending order.", "Order the given numbers from largest to smallest."),
         ("def sort_descending(numbers):\n    return sorted(numbers, reverse=True)",
          "def sort_descending(numbers):\n    result = list(numbers)\n    result.sort(reverse=True)\n"
          "    return result"),
         lambda xs: sorted(xs, reverse=True), lambda rng: (_nums(rng, -10, 40, (3, 7)),)),
    Task("second_largest", ("numbers",),
         ("Write a function that returns the second largest distinct number in a list.",
          "Create a function to find the runner-up value in a list of numbers.",
          "Implement a function that finds the second biggest distinct element of a list."),
         ("Find the second largest number in the given list.", "Print the runner-up value of the given list."),
         ("def second_largest(numbers):\n    return sorted(set(numbers))[-2]",
          "def second_largest(numbers):\n    largest = max(numbers)\n"
          "    return max(n for n in numbers if n != largest)"),
         lambda xs: sorted(set(xs))[-2], lambda rng: (list({*_nums(rng, 0, 30, (3, 7)), 31, 32}),)),
    Task("flatten", ("nested",),
         ("Write a function that flattens a list of lists into a single list.",
          "Create a function to concatenate all the inner lists of a nested list.",
          "Implement a function that turns [[1, 2], [3]] into [1, 2, 3]."),
         ("Flatten the given list of lists.", "Merge the inner lists of the given nested list into one list."),
         ("def flatten(nested):\n    return [x for inner in nested for x in inner]",
          "def flatten(nested):\n    result = []\n    for inner in nested:\n        result.extend(inner)\n"
          "    return result"),
         lambda xss: [x for xs in xss for x in xs], lambda rng: ([_nums(rng, 0, 9, (1, 3)) for _ in range(3)],)),
    Task("word_count", ("text",),
         ("Write a function that counts the words in a sentence.",
          "Create a function returning the number of whitespace-separated words in a text.",
          "Implement a word counter for a string."),
         ("Count the words in the given sentence.", "How many words does the given text have?"),
         ("def word_count(text):\n    return len(text.split())",
          "def word_count(text):\n    count = 0\n    for _ in text.split():\n        count += 1\n    return count"),
         lambda s: len(s.split()), lambda rng: (_sentence(rng),)),
    Task("char_frequency", ("text",),
         ("Write a function that returns a dictionary counting each character of a string.",
          "Create a function to build a character frequency table for a word.",
          "Implement a function mapping every character of a text to how often it occurs."),
         ("Count how often each character occurs in the given word.",
          "Build the character frequency dictionary of the given word."),
         ("def char_frequency(text):\n    counts = {}\n    for c in text:\n        counts[c] = counts.get(c, 0) + 1\n"
          "    return counts",
          "from collections import Counter\n\n\ndef char_frequency(text):\n    return dict(Counter(text))"),
         lambda s: {c: s.count(c) for c in dict.fromkeys(s)}, lambda rng: (rng.choice(WORDS),)),
    Task("is_anagram", ("first", "second"),
         ("Write a function that checks whether two words are anagrams of each other.",
          "Create a function that returns True when two strings contain the same letters.",
          "Implement an anagram check for two words."),
         ("Check whether the two given words are anagrams.", "Are the given words anagrams of each other?"),
         ("def is_anagram(first, second):\n    return sorted(first) == sorted(second)",
          "from collections import Counter\n\n\ndef is_anagram(first, second):\n"
          "    return Counter(first) == Counter(second)"),
         lambda a, b: sorted(a) == sorted(b),
         lambda rng: rng.choice([("listen", "silent"), tuple(rng.sample(WORDS, 2)), ("night", "thing"),
                                 ("stone", "tones"), ("cloud", "could"), ("paper", "pepar")])),
    Task("running_sum", ("numbers",),
         ("Write a function that returns the running (cumulative) sum of a list.",
          "Create a function producing prefix sums of a list of numbers.",
          "Implement a cumulative sum function for a list."),
         ("Compute the running sum of the given list.", "Return the prefix sums of the given numbers."),
         ("def running_sum(numbers):\n    result = []\n    total = 0\n    for n in numbers:\n        total += n\n"
          "        result.append(total)\n    return result",
          "from itertools import accumulate\n\n\ndef running_sum(numbers):\n    return list(accumulate(numbers))"),
         lambda xs: [sum(xs[: i + 1]) for i in range(len(xs))], lambda rng: (_nums(rng, -5, 20, (3, 7)),)),
    Task("to_binary", ("n",),
         ("Write a function that converts a non-negative integer to its binary string.",
          "Create a function returning the base-2 representation of a number without the 0b prefix.",
          "Implement decimal to binary conversion by repeated division."),
         ("Convert the given number to binary.", "Print the binary representation of the given integer."),
         ("def to_binary(n):\n    return bin(n)[2:]",
          "def to_binary(n):\n    if n == 0:\n        return \"0\"\n    digits = \"\"\n    while n > 0:\n"
          "        digits = str(n % 2) + digits\n        n //= 2\n    return digits"),
         lambda n: format(n, "b"), lambda rng: (rng.randint(0, 300),)),
    Task("digit_sum", ("n",),
         ("Write a function that returns the sum of the digits of a non-negative integer.",
          "Create a function adding up the decimal digits of a number.",
          "Implement a digit sum function using integer division."),
         ("Compute the sum of the digits of the given number.", "Add up the digits of the given integer."),
         ("def digit_sum(n):\n    return sum(int(d) for d in str(n))",
          "def digit_sum(n):\n    total = 0\n    while n > 0:\n        total += n % 10\n        n //= 10\n"
          "    return total"),
         lambda n: sum(int(d) for d in str(n)), lambda rng: (rng.randint(0, 99999),)),
    Task("is_leap_year", ("year",),
         ("Write a function that checks whether a year is a leap year.",
          "Create a function implementing the Gregorian leap year rule.",
          "Implement a leap year test (divisible by 4, except centuries not divisible by 400)."),
         ("Check whether the given year is a leap year.", "Is the given year a leap year?"),
         ("def is_leap_year(year):\n    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)",
          "def is_leap_year(year):\n    if year % 400 == 0:\n        return True\n    if year % 100 == 0:\n"
          "        return False\n    return year % 4 == 0"),
         lambda y: y % 4 == 0 and (y % 100 != 0 or y % 400 == 0),
         lambda rng: (rng.choice([rng.randint(1890, 2030), rng.choice([1900, 2000, 2100, 2400])]),)),
    Task("remove_vowels", ("text",),
         ("Write a function that removes all vowels from a string.",
          "Create a function returning a text with its vowels deleted.",
          "Implement a function that strips a, e, i, o and u from a sentence."),
         ("Remove the vowels from the given text.", "Delete every vowel in the given sentence."),
         ("def remove_vowels(text):\n    return \"\".join(c for c in text if c.lower() not in \"aeiou\")",
          "def remove_vowels(text):\n    result = \"\"\n    for c in text:\n        if c.lower() not in \"aeiou\":\n"
          "            result += c\n    return result"),
         lambda s: "".join(c for c in s if c.lower() not in "aeiou"), lambda rng: (_sentence(rng),)),
    Task("longest_word", ("text",),
         ("Write a function that returns the longest word of a sentence (the first one on ties).",
          "Create a function to find the longest word in a text.",
          "Implement a function returning the word with the most characters."),
         ("Find the longest word in the given sentence.", "Print the longest word of the given text."),
         ("def longest_word(text):\n    return max(text.split(), key=len)",
          "def longest_word(text):\n    best = \"\"\n    for word in text.split():\n        if len(word) > len(best):\n"
          "            best = word\n    return best"),
         lambda s: max(s.split(), key=len), lambda rng: (_sentence(rng),)),
    Task("fizzbuzz", ("n",),
         ("Write a function that returns 'Fizz' for multiples of 3, 'Buzz' for multiples of 5, 'FizzBuzz' "
          "for both, and the number as a string otherwise.",
          "Create the classic FizzBuzz function for a single number.",
          "Implement fizzbuzz(n) returning the FizzBuzz word or the number as text."),
         ("Give the FizzBuzz answer for the given number.", "What does FizzBuzz say for the given number?"),
         ("def fizzbuzz(n):\n    if n % 15 == 0:\n        return \"FizzBuzz\"\n    if n % 3 == 0:\n"
          "        return \"Fizz\"\n    if n % 5 == 0:\n        return \"Buzz\"\n    return str(n)",
          "def fizzbuzz(n):\n    word = (\"Fizz\" if n % 3 == 0 else \"\") + (\"Buzz\" if n % 5 == 0 else \"\")\n"
          "    return word or str(n)"),
         _fizzbuzz, lambda rng: (rng.randint(1, 100),)),
    Task("power", ("base", "exponent"),
         ("Write a function that raises a number to a non-negative integer power without using **.",
          "Create a function computing base to the power exponent by repeated multiplication.",
          "Implement integer exponentiation with a loop."),
         ("Compute the given base raised to the given exponent.", "Raise the first number to the second."),
         ("def power(base, exponent):\n    result = 1\n    for _ in range(exponent):\n        result *= base\n"
          "    return result",
          "def power(base, exponent):\n    if exponent == 0:\n        return 1\n"
          "    return base * power(base, exponent - 1)"),
         lambda b, e: b**e, lambda rng: (rng.randint(-4, 9), rng.randint(0, 6))),
    Task("count_char", ("text", "char"),
         ("Write a function that counts how many times a character appears in a string.",
          "Create a function returning the number of occurrences of a letter in a text.",
          "Implement a function to count one character in a string."),
         ("Count how many times the given character appears in the given text.",
          "How often does the given letter occur in the text?"),
         ("def count_char(text, char):\n    return text.count(char)",
          "def count_char(text, char):\n    count = 0\n    for c in text:\n        if c == char:\n"
          "            count += 1\n    return count"),
         lambda s, c: s.count(c), lambda rng: (_sentence(rng), rng.choice("aeiorst"))),
    Task("common_elements", ("first", "second"),
         ("Write a function that returns the sorted list of elements two lists have in common.",
          "Create a function to find the sorted intersection of two lists.",
          "Implement a function returning the values present in both lists, sorted and without repeats."),
         ("Find the elements the two given lists have in common.", "Intersect the two given lists."),
         ("def common_elements(first, second):\n    return sorted(set(first) & set(second))",
          "def common_elements(first, second):\n    result = []\n    for x in first:\n"
          "        if x in second and x not in result:\n            result.append(x)\n    return sorted(result)"),
         lambda a, b: sorted(set(a) & set(b)),
         lambda rng: (_nums(rng, 0, 12, (3, 6)), _nums(rng, 0, 12, (3, 6)))),
    Task("is_sorted", ("numbers",),
         ("Write a function that checks whether a list is sorted in ascending order.",
          "Create a function returning True if every element is at least the one before it.",
          "Implement a check that a list of numbers is in non-decreasing order."),
         ("Check whether the given list is sorted.", "Is the given list in ascending order?"),
         ("def is_sorted(numbers):\n    return all(a <= b for a, b in zip(numbers, numbers[1:]))",
          "def is_sorted(numbers):\n    return numbers == sorted(numbers)"),
         lambda xs: xs == sorted(xs),
         lambda rng: (sorted(_nums(rng, 0, 20, (3, 6))) if rng.random() < 0.5 else _nums(rng, 0, 20, (3, 6)),)),
    Task("pairs_to_dict", ("keys", "values"),
         ("Write a function that builds a dictionary from a list of keys and a list of values.",
          "Create a function to zip two lists into a dictionary.",
          "Implement a function mapping each key to the value at the same position."),
         ("Build a dictionary from the given keys and values.", "Zip the given lists into a dictionary."),
         ("def pairs_to_dict(keys, values):\n    return dict(zip(keys, values))",
          "def pairs_to_dict(keys, values):\n    result = {}\n    for i in range(len(keys)):\n"
          "        result[keys[i]] = values[i]\n    return result"),
         lambda ks, vs: dict(zip(ks, vs, strict=True)),
         lambda rng: (lambda n: (rng.sample(WORDS, n), _nums(rng, 0, 9, (n, n))))(rng.randint(2, 4))),
]


def input_text(args: tuple) -> str:
    """How a call's arguments appear in the row's input column: plain text for one string."""
    if len(args) == 1 and isinstance(args[0], str):
        return args[0]
    return ", ".join(repr(a) for a in args)


def parse_input(task: Task, text: str) -> tuple:
    """The arguments an input column holds (the inverse of :func:`input_text`)."""
    sample = task.make_args(random.Random(0))
    if len(sample) == 1 and isinstance(sample[0], str):
        return (text,)
    return tuple(ast.literal_eval(f"({text},)"))


def snippet(task: Task, solution: str, args: tuple) -> str:
    """A solution that binds the given arguments and prints the result."""
    bind = f"{', '.join(task.params)} = {', '.join(repr(a) for a in args)}"
    return f"{solution}\n\n\n{bind}\nprint({task.func}({', '.join(task.params)}))"


def run(code: str) -> tuple[dict[str, Any], str]:
    """Execute code; return its globals and what it printed."""
    namespace: dict[str, Any] = {"__name__": "sample"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "<answer>", "exec"), namespace)
    return namespace, out.getvalue()


def task_of(output: str) -> Task:
    """The task whose function an answer defines."""
    for task in TASKS:
        if f"def {task.func}(" in output:
            return task
    raise ValueError(f"no known function defined in: {output[:60]!r}")


def check_row(row: dict[str, Any], cases: int = 12) -> None:
    """Raise AssertionError unless the row's answer behaves like the reference implementation."""
    task = task_of(row["output"])
    if row["input"]:
        args = parse_input(task, row["input"])
        _, printed = run(row["output"])
        expected = task.reference(*args)
        assert printed.strip() == str(expected), f"{row['instruction']!r} on {row['input']!r}: printed " \
            f"{printed.strip()!r}, expected {expected!r}"
        return
    namespace, _ = run(row["output"])
    function = namespace[task.func]
    rng = random.Random(row["instruction"])
    for _ in range(cases):
        args = task.make_args(rng)
        got, expected = function(*args), task.reference(*args)
        assert got == expected, f"{task.func}{args!r} returned {got!r}, expected {expected!r}"


def make_rows(seed: int = SEED) -> list[dict[str, Any]]:
    """Every row, checked, shuffled and given a split (deterministic for a seed)."""
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    for task in TASKS:
        for i, ask in enumerate(task.asks):
            rows.append({"instruction": ask, "input": "", "output": task.solutions[i % len(task.solutions)]})
        seen: set[str] = set()
        tries = 0
        while len(seen) < INSTANCES_PER_TASK and tries < 200:
            tries += 1
            args = task.make_args(rng)
            text = input_text(args)
            if text in seen:
                continue
            seen.add(text)
            solution = task.solutions[len(seen) % len(task.solutions)]
            rows.append({"instruction": rng.choice(task.instance_asks), "input": text,
                         "output": snippet(task, solution, args)})
    for row in rows:
        check_row(row)
    rng.shuffle(rows)
    n_train = round(len(rows) * SPLIT_SHARES[0])
    n_val = round(len(rows) * SPLIT_SHARES[1])
    for index, row in enumerate(rows):
        row["split"] = 0 if index < n_train else 1 if index < n_train + n_val else 2
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUTPUT, help="where to write the JSONL")
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args(argv)
    rows = make_rows(args.seed)
    with args.out.open("w") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    counts = [sum(1 for r in rows if r["split"] == s) for s in (0, 1, 2)]
    print(f"wrote {len(rows)} checked rows to {args.out} (train {counts[0]}, validation {counts[1]}, "
          f"test {counts[2]})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

