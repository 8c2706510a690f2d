//! Built-in prompt sets (`--dataset math|code|long`) so a benchmark needs no download: short math
//! questions (reasoning-style decoding), code tasks, and long-context inputs of a few thousand
//! characters (prefill-heavy, like agentic workloads).

/// Short math questions.
pub(crate) const MATH: [&str; 16] = [
    "What is the sum of all positive divisors of 360?",
    "Find the remainder when 7^2026 is divided by 100.",
    "How many ways can 8 identical balls be placed into 3 distinct boxes?",
    "Solve for x: 3x + 7 = 2(x - 4) + 19.",
    "A rectangle has perimeter 46 and area 120. What are its side lengths?",
    "What is the smallest positive integer n such that n! is divisible by 1000?",
    "Compute the sum 1/(1*2) + 1/(2*3) + ... + 1/(99*100).",
    "How many positive integers less than 1000 are divisible by 3 or 5 but not by 15?",
    "Find all real solutions of x^2 - 5x + 6 = 0 and verify them.",
    "The angles of a triangle are in the ratio 2:3:4. Find the largest angle in degrees.",
    "What is the probability of getting exactly two heads in five fair coin tosses?",
    "Find the greatest common divisor of 1071 and 462 using the Euclidean algorithm.",
    "A geometric sequence has first term 3 and ratio 2. What is the sum of its first 10 terms?",
    "How many diagonals does a convex polygon with 12 sides have?",
    "If log_2(x) + log_2(x - 2) = 3, what is x?",
    "What is the last digit of 3^100 + 7^100?",
];

/// Code tasks.
pub(crate) const CODE: [&str; 16] = [
    "Write a Python function that returns the n-th Fibonacci number in O(log n) time.",
    "Implement binary search in Rust over a sorted slice of i64 and return Option<usize>.",
    "Write a SQL query that returns the three customers with the highest total order value.",
    "Write a JavaScript function that debounces another function by a given number of ms.",
    "Implement an LRU cache in Python with get and put in O(1).",
    "Write a C function that reverses a singly linked list in place.",
    "Write a Rust function that parses a line like `key=value; k2=v2` into a HashMap.",
    "Write a shell one-liner that prints the ten largest files under the current directory.",
    "Implement merge sort in Go and explain its time and space complexity.",
    "Write a Python generator that yields all permutations of a list without itertools.",
    "Write a regular expression that matches ISO 8601 dates (YYYY-MM-DD) and explain it.",
    "Implement a thread-safe counter in Java using AtomicLong and show how to use it.",
    "Write a TypeScript type that makes every property of an object type optional, recursively.",
    "Write a Python function that checks whether a string of brackets ()[]{} is balanced.",
    "Implement Dijkstra's shortest-path algorithm in C++ with a priority queue.",
    "Write a Rust iterator adapter that yields every other element of the inner iterator.",
];

/// Paragraphs the long-context documents are assembled from.
const PARAGRAPHS: [&str; 10] = [
    "The harbour town of Velmora grew around a sheltered bay on the northern coast. For three \
centuries its economy rested on salted fish, rope and sailcloth; the ropewalk, a covered lane nearly \
four hundred metres long, still runs parallel to the quay. In 1871 a railway reached the town and \
the fish market moved inland, next to the station, so that the morning catch could be on city tables \
by the evening. The old market hall became a warehouse, then a school, and since 1998 a museum.",
    "Velmora's population peaked at 41,000 in 1932 and fell to 23,500 by 1990, when the last cannery \
closed. The municipality responded with a plan built on three measures: a technical college \
specialising in marine engineering, tax relief for firms that restored listed buildings, and a ferry \
link to the islands that cut the crossing from five hours to ninety minutes. By 2020 the population \
had recovered to 29,800, and the college had 3,100 students, a third of them from abroad.",
    "The town council has 27 seats. After the 2022 election the Harbour Party held 11, the Greens 7, \
the Liberal Union 5 and independents 4. A coalition of the Harbour Party and the Greens governs with \
18 seats. Its programme commits to a car-free old town by 2028, the electrification of the ferry \
fleet, and 600 new social housing units, of which 240 must be built on former port land that is \
currently used for container storage.",
    "The climate is oceanic. Average temperatures range from 3 degrees Celsius in January to 17 in \
August, and the annual rainfall of 1,240 mm is spread over 190 days. Storms from the north-west are \
most frequent between October and February; the breakwater, extended in 1964 and raised by 1.2 \
metres in 2011, protects the inner harbour, but the fish quay still floods about four times a year \
when a spring tide coincides with an onshore gale.",
    "Velmora's budget for 2024 was 212 million. Education took 31 percent, social services 24 \
percent, transport 14 percent, housing 9 percent, culture and sport 6 percent, and administration \
the rest. Revenue came from local taxes (46 percent), transfers from the regional government (38 \
percent), port fees (9 percent) and other income. The council borrowed 18 million to co-finance the \
electric ferries, repayable over twenty years at a fixed rate of 3.1 percent.",
    "The ferry service operates three vessels. The two older ships, built in 1996 and 2001, carry \
420 passengers and 60 cars each and burn about 3,800 litres of diesel per round trip. The newest \
ship, delivered in 2023, is a battery-electric catamaran for 300 passengers and 40 cars; it charges \
for twelve minutes at each end of the route from shore-side units fed by a dedicated 10 kV cable. \
The operator reports that the electric ship has had 97.6 percent availability in its first year.",
    "A 2023 survey of 1,850 residents found that 62 percent supported the car-free old town, 28 \
percent opposed it and 10 percent had no opinion. Support was highest among residents under 35 (74 \
percent) and lowest among owners of shops in the old town (41 percent). The most frequent concern, \
named by 53 percent of opponents, was delivery access; the council has proposed a delivery window \
from 6 to 10 in the morning and a fleet of small electric cargo bikes operated by a cooperative.",
    "The marine engineering college runs a test basin 80 metres long in which model hulls are towed \
at up to 6 metres per second. Since 2015 it has hosted a research group on hydrogen fuel cells for \
small vessels. Its first prototype, a 12-metre pilot boat, completed 1,400 hours of trials; the \
group concluded that hydrogen storage at 350 bar took too much deck space and is now testing \
liquid organic hydrogen carriers, which are bulkier per kilowatt-hour but can be bunkered like diesel.",
    "Tourism brings about 310,000 overnight stays a year, 70 percent of them between June and \
September. The museum in the old market hall receives 85,000 visitors, and the annual rope festival \
in August, where teams race to lay a 200-metre rope by hand on the historic ropewalk, draws around \
15,000 spectators. Hotel occupancy averages 81 percent in summer and 34 percent in winter, which \
the tourist board hopes to even out with conference offers tied to the college.",
    "The port land reserved for housing covers 9.4 hectares. Soil tests in 2022 found hydrocarbon \
contamination on 2.1 hectares near the old fuel depot, where remediation is estimated at 7.5 \
million and two years of work. The container operator's lease runs until 2027; the council intends \
to move container storage to a new inland terminal next to the railway, which would also let \
freight leave by train instead of by lorry through the town centre.",
];

/// Questions asked about the long documents.
const LONG_TASKS: [&str; 16] = [
    "Summarise the document above in five bullet points.",
    "How many of the council's seats does the governing coalition hold, and is that a majority?",
    "Estimate how much diesel the two older ferries burn per day if each makes six round trips.",
    "List every number in the document that is a percentage, with what it refers to.",
    "What risks could delay the 240 housing units on port land? Cite the document.",
    "Write a short briefing for a new council member about transport in Velmora.",
    "Compare the population in 1932, 1990 and 2020 and describe the trend.",
    "What share of the 2024 budget went to administration? Show the calculation.",
    "Draft three survey questions that would clarify residents' concerns about deliveries.",
    "Explain why the hydrogen research group changed its storage approach.",
    "What would the annual repayment of the ferry loan be, roughly, assuming equal instalments?",
    "Identify two ways the document suggests reducing seasonal swings in tourism.",
    "Which facts in the document relate to climate adaptation? Explain each briefly.",
    "Write a timeline of the events mentioned in the document, oldest first.",
    "What information is missing to judge whether the car-free old town will succeed?",
    "Translate the first paragraph of the document into plain English for a child of ten.",
];

/// Long-context prompts: a document of seven paragraphs (rotated per task) and a question.
pub(crate) fn long_prompts() -> Vec<String> {
    LONG_TASKS
        .iter()
        .enumerate()
        .map(|(i, task)| {
            let doc: Vec<&str> = (0..7)
                .map(|k| PARAGRAPHS[(i + 3 * k) % PARAGRAPHS.len()])
                .collect();
            format!(
                "Read the following document about the town of Velmora and answer the question.\n\n\
                 {}\n\nQuestion: {task}",
                doc.join("\n\n")
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_prompts_are_a_few_thousand_characters_and_distinct() {
        let prompts = long_prompts();
        assert_eq!(prompts.len(), 16);
        for p in &prompts {
            assert!((2500..6000).contains(&p.len()), "{}", p.len());
        }
        let mut unique = prompts.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), 16);
    }
}
