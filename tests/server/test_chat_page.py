#!/usr/bin/env python3
"""The built-in chat page (GET /) in a real headless browser: Debian's chromium + chromium-driver, driven
by Selenium. Sends messages with MTP on and off, waits for the streamed answers, checks the per-message
stats (tok/s, acceptance, tokens per step) and the code-block rendering, and saves a screenshot.

    python3 tests/server/test_chat_page.py --binary build/mtpx [--screenshot out.png]

Exits 77 (ctest: skipped) when selenium, chromium or chromedriver is missing.
"""
import argparse
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mtpx_server import SKIP, MtpxServer  # noqa: E402

try:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait
except ImportError:
    print("skipped: selenium is not installed (bash scripts/setup.sh --test-python)")
    sys.exit(SKIP)


def find_browser():
    chromium = next((p for p in (shutil.which("chromium"), shutil.which("chromium-browser")) if p), None)
    driver = shutil.which("chromedriver") or ("/usr/bin/chromedriver" if os.path.exists("/usr/bin/chromedriver") else None)
    return chromium, driver


def start_browser(chromium, driver_path):
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--window-size=1280,900"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(driver_path), options=options)


def send_and_wait(browser, text, timeout=90):
    """Types a message, sends it, and returns the finished assistant message element."""
    before = len(browser.find_elements(By.CSS_SELECTOR, ".message.assistant"))
    box = browser.find_element(By.ID, "prompt")
    box.clear()
    box.send_keys(text.split("\n")[0])  # typed (Enter would send, so later lines are set directly)
    if "\n" in text:
        browser.execute_script("arguments[0].value = arguments[1]", box, text)
    browser.find_element(By.ID, "send").click()
    wait = WebDriverWait(browser, timeout)
    wait.until(lambda b: len(b.find_elements(By.CSS_SELECTOR, ".message.assistant")) > before)
    reply = browser.find_elements(By.CSS_SELECTOR, ".message.assistant")[-1]
    wait.until(lambda b: reply.get_attribute("data-state") == "done")
    return reply


def check(condition, message):
    if not condition:
        raise AssertionError(message)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--binary", required=True)
    parser.add_argument("--screenshot", default="chat_page.png")
    args = parser.parse_args()
    chromium, driver_path = find_browser()
    if not chromium or not driver_path:
        print("skipped: chromium / chromedriver not installed (apt-get install chromium chromium-driver)")
        return SKIP

    os.makedirs(os.path.dirname(os.path.abspath(args.screenshot)), exist_ok=True)
    server = MtpxServer(os.path.abspath(args.binary), "--quiet", "--draft", "1")  # MTP on, whatever `mtpx tune` saved
    browser = None
    try:
        browser = start_browser(chromium, driver_path)
        browser.get(server.url + "/")
        WebDriverWait(browser, 30).until(ec.text_to_be_present_in_element((By.ID, "model"), "default"))
        check(browser.find_element(By.ID, "mtp").is_selected(), "MTP should be on by default")
        browser.find_element(By.ID, "max_tokens").clear()
        browser.find_element(By.ID, "max_tokens").send_keys("48")
        browser.find_element(By.ID, "temperature").send_keys("0")

        # 1. MTP on: a streamed answer with speed and acceptance.
        reply = send_and_wait(browser, "def reverse_string(s):")
        body = reply.find_element(By.CSS_SELECTOR, ".body").text
        stats = reply.find_element(By.CSS_SELECTOR, ".stats").text
        print(f"answer: {body[:80]!r}...\nstats: {stats}")
        check(body.strip() != "", "the answer is empty")
        check("tok/s" in stats and "acceptance" in stats and "tokens/step" in stats, f"stats missing: {stats}")
        check("error" not in reply.get_attribute("class"), "the answer is an error")

        # 2. Code blocks render as <pre><code> (a fenced block in the user's message, rendered the same way).
        send_and_wait(browser, "Explain:\n```python\nprint('hi')\n```")
        code = browser.find_elements(By.CSS_SELECTOR, ".message.user pre code")
        check(code and "print('hi')" in code[-1].text, "the fenced block was not rendered as code")

        # 3. MTP off from the switch: no acceptance, the stats say so.
        browser.find_element(By.ID, "mtp").click()
        reply = send_and_wait(browser, "Now a function that sums a list.")
        stats = reply.find_element(By.CSS_SELECTOR, ".stats").text
        print(f"stats (MTP off): {stats}")
        check("MTP off" in stats and "tok/s" in stats, f"stats with MTP off: {stats}")

        browser.save_screenshot(args.screenshot)
        print(f"screenshot: {args.screenshot}")
        return 0
    except AssertionError as e:
        print(f"FAIL: {e}")
        if browser:
            browser.save_screenshot(args.screenshot)
        return 1
    finally:
        if browser:
            browser.quit()
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
